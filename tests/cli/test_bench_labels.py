"""A bench table, plot or JSON says what it measured (the zenflow preset, the --set keys, the dtype),
warns that timings are noisy, and is written readable by others (0666 less the umask, not 0600)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import widen_consoles
from typer.testing import CliRunner

from zfctl.bench.report import noise_note, settings_line
from zfctl.cli import app

runner = CliRunner()
SMALL = ["bench", "--hidden-dim", "32", "--nlayers", "1", "--dtype", "fp32", "--topk", "0.25", "--interval", "2",
         "--warmup", "2", "--iterations", "1", "--device", "cpu"]


def test_tables_and_json_name_the_preset_the_set_keys_and_the_dtype(tmp_path, monkeypatch):
    widen_consoles(monkeypatch)
    old = os.umask(0o022)
    try:
        res = runner.invoke(app, [*SMALL, "--zenflow", "default", "--set", "zenflow.tuning.install_lag=1",
                                  "--json", str(tmp_path / "b.json")], env={"COLUMNS": "200"})
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    line = "--zenflow default --set zenflow.tuning.install_lag=1, dtype fp32, accumulate auto"
    assert line in res.output
    assert "note: timings are noisy" in res.output and "--trials 3" in res.output
    meta = json.loads((tmp_path / "b.json").read_text())["meta"]
    assert (meta["zenflow_preset"], meta["zenflow_set"]) == ("default", ["zenflow.tuning.install_lag=1"])
    assert settings_line(meta) == line
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o644


def test_the_noise_note_reports_the_spread_of_trials():
    rows = [{"trial_overall_ms": [10.0, 12.5, 11.0]}, {"trial_overall_ms": [4.0, 4.2]}]
    assert noise_note(rows, {}).startswith("the trials of one row differ by up to 25% of their mean step time")
    assert noise_note([{"trial_overall_ms": [10.0]}], {}).startswith("timings are noisy")


def test_the_plot_is_readable_by_others(tmp_path):
    pytest.importorskip("matplotlib")
    from zfctl.bench.plot import plot

    rows = [{"label": "off", "stall_fraction": 0.0,
             "step_ms": {"accumulate": {"mean": 5.0}, "update": {"mean": None}, "overall": {"mean": 5.0}}}]
    old = os.umask(0o022)
    try:
        plot(rows, tmp_path / "p.png", {"model": "m", "device": "cpu", "zenflow_preset": "paper", "dtype": "fp32",
                                        "accumulate": "auto"})
    finally:
        os.umask(old)
    assert (tmp_path / "p.png").stat().st_mode & 0o777 == 0o644
