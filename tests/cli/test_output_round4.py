"""What a new user reads first, round four: `zfctl plan` leads with its verdict and totals (the
whole plan was ~90 lines above it), the step line's ~600-character legend only where it is news,
a `next:` block's export into a folder of its own, and `make setup` without pip's lines around its
own. Whole runs for the `next:` blocks and the legend: tests/e2e/test_next_blocks.py."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.plan import machine
from zfctl.plan.resolve import resolve_plan
from zfctl.train.display import STEP_LINE_LEGEND, RichDisplay

ROOT = Path(__file__).resolve().parents[2]
TINY = ["plan", "tiny-llama", "--data", "alpaca-sample"]
# llama2-7b on a 24 GB card: does not fit, and --fit's changes make it fit
NO_FIT = ["plan", "llama2-7b", "--data", "alpaca", "--gpu-memory", "24GB", "--host-memory", "192GB"]


@pytest.fixture(autouse=True)
def small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU, 24 GB RAM, whatever machine runs the test (the plan checks against this one)."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("ZFCTL_VERBOSE", raising=False)
    monkeypatch.setattr(machine, "this_machine", lambda: machine.Machine(host_ram=24 * machine.GB, cuda=False))


def plan_out(*args: str) -> tuple[int, list[str]]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.stdout.splitlines()


def table_total(lines: list[str], row: str) -> str:
    """The size cell of the memory table's row ``row`` (``device total``, ``host total``)."""
    (cells,) = [[c.strip() for c in ln.strip("│").split("│")] for ln in lines if f"│ {row} " in ln]
    return cells[2]


def test_plan_leads_with_the_verdict_then_the_totals_and_the_machine() -> None:
    code, lines = plan_out(*TINY)
    assert code == 0
    assert lines[0] == "it fits"  # was the 100th line, under the whole plan and the memory table
    device, host = table_total(lines, "device total"), table_total(lines, "host total")
    assert lines[1] == f"totals: device {device}, host {host} (no CUDA: the device side would use host RAM)"
    assert lines[2] == "checked against: 24.0 GB RAM (18.0 GB usable), no CUDA device"
    # below: the plan's main keys (every key: --verbose), then the table the totals add up
    start = lines.index("run plan (the keys that matter and every key changed from its default; --verbose "
                        "prints all, --json holds all)")
    assert lines[start + 1] == "  model: name=tiny-llama source=config tokenizer=embedded"
    assert lines.index(next(ln for ln in lines if ln.startswith("memory estimate"))) > start
    assert not any("ring_slot_mb" in ln for ln in lines)  # a key left at its default: --verbose only


def test_plan_verbose_prints_every_key_under_the_same_lead() -> None:
    code, brief = plan_out(*TINY)
    code_v, full = plan_out(*TINY, "--verbose")
    assert code == code_v == 0
    assert full[:3] == brief[:3]
    assert "run plan" in full  # the title of the whole plan's table
    assert any(re.fullmatch(r"\s+ring_slot_mb\s+32\.0", ln) for ln in full)
    assert len(full) > len(brief) + 60


def test_a_plan_that_does_not_fit_says_so_first_then_what_to_change() -> None:
    code, lines = plan_out(*NO_FIT)
    assert code == 3
    assert lines[0].startswith("it does not fit: device memory: needs "), lines[0]
    assert lines[1].startswith("totals: device ") and lines[2].startswith("checked against: 192.0 GB RAM")
    advice = lines.index("to make it fit, add (cheapest first; or pass --fit):")
    assert advice < next(i for i, ln in enumerate(lines) if ln.startswith("run plan"))
    code, fitted = plan_out(*NO_FIT, "--fit")
    assert code == 0 and fitted[0] == "it fits"
    assert fitted[3].startswith("--fit changed: --set "), fitted[:5]


def test_the_legend_is_printed_only_when_asked() -> None:
    """recipe.py asks for it on a run folder's first run (and with --verbose), not on a resume."""
    for legend in (True, False):
        out = io.StringIO()
        display = RichDisplay(Console(file=out, width=200), legend=legend)
        display.start(10, 0)
        display.print("step 1/10 | loss 1.0")
        display.close()
        assert (STEP_LINE_LEGEND in out.getvalue()) is legend


def test_each_next_block_exports_into_a_new_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block a resume prints must not name the folder the finetune's block exported into
    (export refuses it, exit 2); a folder already there is never replaced either."""
    from zfctl.cli import finetune

    monkeypatch.setattr(finetune, "activate_command", lambda: None)
    monkeypatch.chdir(tmp_path)
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.max_steps=6"])

    def export_line(steps: int) -> str:
        (line,) = [c for c in finetune.next_commands(plan, Path("runs/x"), steps) if c.startswith("zfctl export")]
        return line

    assert export_line(6) == "zfctl export runs/x --output runs/x-hf-step6"
    assert export_line(12) == "zfctl export runs/x --output runs/x-hf-step12"  # the resumed run's
    (tmp_path / "runs" / "x-hf-step6").mkdir(parents=True)
    assert export_line(6) == "zfctl export runs/x --output runs/x-hf-step6"  # empty: export writes into it
    (tmp_path / "runs" / "x-hf-step6" / "config.json").write_text("{}")
    (tmp_path / "runs" / "x-hf-step6-2").write_text("a file")
    assert export_line(6) == "zfctl export runs/x --output runs/x-hf-step6-3"  # a run replaced by --force


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def setup_commands(tmp_path: Path, *flags: str) -> list[str]:
    """The commands `make setup` would run for a fresh .venv (make -n: printed, not run)."""
    res = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), f"VENV={tmp_path / 'venv'}", *flags, "setup"],
                         capture_output=True, text=True, check=False, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


@needs_make
def test_make_setup_keeps_pip_quiet_around_its_own_lines(tmp_path: Path) -> None:
    quiet = setup_commands(tmp_path)
    pips = [ln for ln in quiet if " -m pip install " in ln]
    assert len(pips) == 2 and all(" -q " in ln for ln in pips), pips
    own = [ln for ln in quiet if ln.startswith("echo \"setup ")]
    assert [ln.split(":")[0] for ln in own] == ['echo "setup 1/3', 'echo "setup 2/3', 'echo "setup 3/3']
    assert "VERBOSE=1" in own[0]  # says where pip's output went
    loud = [ln for ln in setup_commands(tmp_path, "VERBOSE=1") if " -m pip install " in ln]
    assert len(loud) == 2 and not any(" -q " in ln for ln in loud), loud


def test_quiet_pip_still_shows_its_errors() -> None:
    """-q hides pip's progress and its "Collecting" lines, not a failure (offline: --no-index)."""
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-index",
                          "zfctl-no-such-package-i42"], capture_output=True, text=True, check=False, timeout=120)
    assert res.returncode != 0
    assert "ERROR: " in res.stderr and "zfctl-no-such-package-i42" in res.stderr, res.stderr
    assert res.stdout == ""
