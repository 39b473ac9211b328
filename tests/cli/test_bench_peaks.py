"""`zfctl bench --baselines` and the per-configuration memory peaks the GPU check reads, on CPU."""

from __future__ import annotations

import csv
import json
import mmap

import pytest
import torch
from typer.testing import CliRunner

from zfctl.bench.grid import build_grid, parse_baselines
from zfctl.bench.memory import read_peaks, reset_peaks
from zfctl.cli import app
from zfctl.errors import UserError

runner = CliRunner()
TINY = ("--hidden-dim", "32", "--nlayers", "1", "--dtype", "fp32", "--topk", "0.25", "--interval", "2",
        "--warmup", "2", "--iterations", "1", "--device", "cpu")


def bench(tmp_path, *args: str) -> tuple[dict, list[dict]]:
    res = runner.invoke(app, ["bench", *TINY, *args, "--json", str(tmp_path / "b.json"),
                              "--csv", str(tmp_path / "b.csv")], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return json.loads((tmp_path / "b.json").read_text()), list(csv.DictReader((tmp_path / "b.csv").open()))


def test_parse_baselines():
    assert parse_baselines("off,zero-offload") == ("off", "zero-offload")
    assert parse_baselines("zero-offload,off") == ("off", "zero-offload")  # one order, whatever was typed
    assert parse_baselines("off") == ("off",)
    assert parse_baselines("none") == ()
    for bad in ("none,off", "offload", "off,", ""):
        with pytest.raises(UserError, match="--baselines"):
            parse_baselines(bad)


def test_grid_without_zero_offload_keeps_the_point_it_would_have_repeated():
    with_zo = build_grid([0.0], [1], [False], [True], with_off=False)
    without = build_grid([0.0], [1], [False], [True], with_off=False, with_zero_offload=False)
    assert [c.name for c in with_zo] == ["zero-offload"]
    assert [(c.name, c.topk, c.interval) for c in without] == [("zenflow", 0.0, 1)]


def test_baselines_none_runs_the_grid_only_and_records_what_was_asked(tmp_path):
    doc, rows = bench(tmp_path, "--baselines", "none", "--accumulate", "host")
    assert [r["name"] for r in doc["results"]] == ["zenflow"]
    assert doc["meta"]["baselines"] == [] and doc["meta"]["accumulate"] == "host"
    assert [r["name"] for r in rows] == ["zenflow"]


def test_baselines_off_only(tmp_path):
    doc, _ = bench(tmp_path, "--baselines", "off")
    assert [r["name"] for r in doc["results"]] == ["off", "zenflow"]
    assert doc["results"][1]["speedup_vs_zero_offload"] is None  # no yardstick ran: no speedup, not 0


def test_bad_baselines_is_one_line_before_anything_runs(tmp_path):
    res = runner.invoke(app, ["bench", *TINY, "--baselines", "zero", "--json", str(tmp_path / "b.json")])
    assert res.exit_code == 2
    assert "--baselines 'zero'" in res.output and "zfctl bench:" not in res.output
    assert not (tmp_path / "b.json").exists()


def test_every_row_has_its_memory_peaks(tmp_path):
    doc, rows = bench(tmp_path)
    assert [r["name"] for r in doc["results"]] == ["zero-offload", "off", "zenflow"]
    assert doc["meta"]["host_rss_peak_scope"] in ("configuration", "process")
    for r, c in zip(doc["results"], rows, strict=True):
        assert r["peak_host_rss_bytes"] > 50 * 2**20  # torch alone keeps more than 50 MiB resident
        assert r["peak_device_allocated_bytes"] is None and r["peak_device_reserved_bytes"] is None  # CPU
        assert int(c["peak_host_rss_bytes"]) == r["peak_host_rss_bytes"]
        assert c["peak_device_reserved_bytes"] == ""


def test_reset_peaks_starts_a_new_host_window():
    if not reset_peaks(torch.device("cpu")):
        pytest.skip("this kernel refuses /proc/self/clear_refs: peaks cover the whole process")
    # 256 MiB of anonymous memory, every page touched, given back to the kernel at close(): a
    # torch tensor's pages may stay resident after `del` in a process (an xdist worker) whose
    # allocators already hold freed memory, and then no window could drop them.
    big = mmap.mmap(-1, 256 * 2**20)
    for offset in range(0, len(big), mmap.PAGESIZE):
        big[offset] = 1
    during = read_peaks(torch.device("cpu"))["peak_host_rss_bytes"]
    big.close()
    assert reset_peaks(torch.device("cpu"))
    after = read_peaks(torch.device("cpu"))["peak_host_rss_bytes"]
    assert during is not None and after is not None
    assert during - after > 200 * 2**20  # the freed buffer is no longer in the new window's peak
