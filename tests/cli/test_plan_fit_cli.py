"""`zfctl plan` on the small machines docs/memory.md promises (section "zfctl plan"), `--fit`, the exit code of a plan that
does not fit, and the bad memory sizes (the real CLI, in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.cli.plan import DOES_NOT_FIT
from zfctl.plan import machine
from zfctl.plan.memory import GB, Machine, estimate
from zfctl.plan.resolve import resolve_plan

runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rich reads COLUMNS at each print: whole phrases on one line, and nothing left behind (setting
    the consoles' width instead would pin it, at its old value, for the tests that follow)."""
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(autouse=True)
def small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here, 24 GB RAM: every row names its machine with --gpu-memory / --host-memory."""
    monkeypatch.setattr(machine, "this_machine", lambda: machine.Machine(host_ram=24 * machine.GB, cuda=False))


def zf(*args: str):
    return runner.invoke(app, [str(a) for a in args])


# The machines zfctl promises to fit: each fits the default preset with ZenFlow on (the 24 GB
# card with --fit). What makes them fit: one set of gradient slots with overlap (the host paths:
# 12 B of master and moments, 4 x 2 B of bf16 slots, 4 B for a checkpoint's interval sum: 24 B
# per host element, 32 with two sets), and gradient release (one .grad at a time, not a bf16
# copy of every parameter) for the 24 GB card.
# The hosts are 1.5x what they were before the slots (37, 128, 256, 128 GB at 16 B per element).
ROWS = [
    pytest.param("llama3.2-1b", "16GB", "48GB", ["--set", "train.precision=fp16"], id="llama3.2-1b-16GB"),
    pytest.param("llama2-7b", "48GB", "192GB", [], id="llama2-7b-48GB"),
    pytest.param("llama2-13b", "80GB", "384GB", [], id="llama2-13b-80GB"),
    pytest.param("llama2-7b", "24GB", "192GB", ["--fit"], id="llama2-7b-24GB"),
]


@pytest.mark.parametrize(("model", "gpu", "host", "extra"), ROWS)
def test_acceptance_rows_fit(model: str, gpu: str, host: str, extra: list[str]) -> None:
    base = ["plan", model, "--data", "alpaca", "--gpu-memory", gpu, "--host-memory", host, *extra]
    result = zf(*base)
    assert result.exit_code == 0, result.output
    assert "it fits" in result.output
    data = json.loads(zf(*base, "--json").stdout)
    assert data["memory"]["fits"] is True and data["fit"]["fits"] is True
    assert data["plan"]["zenflow"]["topk_ratio"] >= 0.05  # ZenFlow on
    assert data["memory"]["device_kind"] == "cuda"
    if "--fit" in extra:
        assert data["fit"]["applied"] is True
        for change in data["fit"]["changes"]:  # the JSON plan is the fitted one
            for key, value in change["set"].items():
                section, name = key.split(".", 1)
                assert data["plan"][section][name] == value


def test_a_plan_that_does_not_fit_lists_the_changes_and_exits_3() -> None:
    args = ["plan", "llama3.2-1b", "--data", "alpaca", "--set", "data.max_length=4096", "--set",
            "train.micro_batch_size=4", "--set", "train.activation_checkpointing=false",
            "--gpu-memory", "40GB", "--host-memory", "256GB"]
    result = zf(*args)
    assert result.exit_code == DOES_NOT_FIT == 3, result.output
    assert "it does not fit" in result.output
    assert "to make it fit, add (cheapest first; or pass --fit):" in result.output
    assert "--set train.activation_checkpointing=true" in result.output
    data = json.loads(zf(*args, "--json").stdout)
    assert data["memory"]["fits"] is False and data["fit"]["applied"] is False
    assert data["fit"]["fits"] is True and data["fit"]["changes"][0]["set"] == {"train.activation_checkpointing": True}
    assert data["plan"]["train"]["activation_checkpointing"] is False  # without --fit: the plan as given
    fitted = zf(*args, "--fit", "--json")
    assert fitted.exit_code == 0
    data = json.loads(fitted.stdout)
    assert data["memory"]["fits"] is True and data["plan"]["train"]["activation_checkpointing"] is True
    shown = zf(*args, "--fit")
    assert shown.exit_code == 0 and "it fits" in shown.output
    assert "--fit changed: --set train.activation_checkpointing=true" in shown.output


def test_plan_that_fits_exits_0() -> None:
    result = zf("plan", "llama2-7b", "--data", "alpaca", "--gpu-memory", "80GB", "--host-memory", "128GB")
    assert result.exit_code == 0 and "it fits" in result.output and "to make it fit" not in result.output


def _one_error_line(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("verb", ["plan", "finetune"])
def test_fit_on_a_plan_nothing_fits_is_one_error_line(verb: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = zf(verb, "llama2-13b", "--data", "alpaca", "--gpu-memory", "8GB", "--host-memory", "16GB", "--fit",
                "--output", out)
    _one_error_line(result, "--fit: nothing makes this plan fit", "--gpu-memory")
    assert not out.exists()


@pytest.mark.parametrize("size", ["lots", "1e400GB", "inf", "nanGB", "80", "2e3TB"])
@pytest.mark.parametrize("flag", ["--gpu-memory", "--host-memory"])
def test_a_bad_memory_size_is_one_error_line(flag: str, size: str) -> None:
    _one_error_line(zf("plan", "tiny-llama", "--data", "alpaca-sample", flag, size), flag, repr(size))


@pytest.mark.parametrize("size", ["1e400GB", "lots"])
def test_a_bad_memory_size_is_one_error_line_for_finetune_and_set(size: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _one_error_line(zf("finetune", "tiny-llama", "--data", "alpaca-sample", "--gpu-memory", size, "--output", out),
                    "--gpu-memory", repr(size))
    _one_error_line(zf("plan", "tiny-llama", "--data", "alpaca-sample", "--set", f"machine.host_memory={size}"),
                    "machine.host_memory", repr(size))
    assert not out.exists()


def test_finetune_fit_applies_the_changes_and_the_run_uses_them(tmp_path: Path) -> None:
    """tiny-llama on the CPU with a host size between what the plan needs without and with the
    recompute: --fit turns it on, plan.yaml says so, and the run trains. One slot set, fixed: with
    ``auto`` the small host would drop the second set (16 B per host element in fp32 at
    update_interval 4), more than the recompute saves, and nothing would be left to fit."""
    sets = ["train.device=cpu", "train.precision=fp32", "zenflow.tuning.host_accumulators=1",
            "train.activation_checkpointing=false"]
    need = {}
    for on in (False, True):
        plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[*sets[:3], f"train.activation_checkpointing={on}"])
        est = estimate(plan, Machine(64 * GB, False))
        need[on] = est.host_total + est.device_total
    host = int((need[False] + need[True]) / 2 / 0.75)  # zfctl/plan/memory.py host_limit: 3/4 of a small machine
    out = tmp_path / "run"
    args = ["finetune", "tiny-llama", "--data", "alpaca-sample", *[a for s in sets for a in ("--set", s)],
            "--host-memory", f"{host}B", "--max-steps", "1", "--set", "train.eval_every=0",
            "--set", "train.eval_batches=1", "--output", out]
    result = zf(*args, "--fit")
    assert result.exit_code == 0, result.output
    assert "--fit changed: --set train.activation_checkpointing=true" in result.output
    assert "activation_checkpointing: true" in (out / "plan.yaml").read_text()


def test_finetune_warns_with_the_flags_fit_would_add(capsys: pytest.CaptureFixture[str]) -> None:
    """The run goes on (the activations are rough), but its warning names the way out."""
    from zfctl.cli.finetune import _memory_line

    plan = resolve_plan("llama3.2-1b", "alpaca", overrides=[
        "data.max_length=4096", "train.micro_batch_size=4", "train.activation_checkpointing=false",
        "machine.gpu_memory=40GB", "machine.host_memory=256GB"])
    _memory_line(plan)
    err = capsys.readouterr().err.replace("\n", " ")
    assert "warning: memory:" in err and "does not fit" in err
    assert "--fit would add --set train.activation_checkpointing=true" in err
