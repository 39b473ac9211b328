"""The real CLI: SIGKILL mid-checkpoint, SIGTERM, and bad input -> exit 2.

The signal tests start `python -m zfctl` like a user would; the bad inputs, refused in their
pre-flight, run through the Typer app but for the one that needs a rank's environment. A tiny-llama
variant keeps steps short.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import widen_consoles
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.train.checkpoint import read_checkpoint, resolve_checkpoint
from zfctl.train.metrics import read_metrics
from zfctl.train.testhooks import SLOW_WRITE_ENV

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=96", "data.max_length=64", "train.micro_batch_size=4", "train.eval_batches=2",
    "train.device=cpu", "train.precision=fp32", "train.eval_every=0", "logging.every=1",
    "zenflow.update_interval=4", "zenflow.overlap_step=true", "zenflow.topk_ratio=0.1",
    "zenflow.full_warm_up_rounds=0",  # these few steps are about the steady state, not the warm-up
]


def zfctl(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zfctl", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "COLUMNS": "200", **(env or {})}, **kw)


def finetune(out: Path, *extra: str, data: str = "alpaca-sample", model: str = "tiny-llama",
             env: dict | None = None) -> subprocess.Popen:
    sets = [a for s in [*TINY, *extra] for a in ("--set", s)]
    return zfctl("finetune", model, "--data", data, "--output", str(out), *sets, env=env)


def finish(p: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def wait_for(cond, p: subprocess.Popen, timeout: float = 180) -> None:
    t0 = time.time()
    while not cond():
        if p.poll() is not None:
            raise AssertionError(f"process ended early (rc {p.returncode}):\n{p.stdout.read()}")
        if time.time() - t0 > timeout:
            p.kill()
            raise AssertionError("timed out")
        time.sleep(0.05)


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_sigkill_during_checkpoint_write_keeps_previous_and_resume_works(tmp_path):
    out = tmp_path / "run"
    # the step-4 checkpoint write sleeps after its model file: SIGKILL lands mid-write
    p = finetune(out, "train.max_steps=6", "checkpoint.every=2", env={SLOW_WRITE_ENV: "4:120"})
    partial = out / "checkpoints" / ".tmp-step-000004" / "model.safetensors"
    wait_for(partial.exists, p)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL

    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000002"
    assert not (ckpts / "step-000004").exists()
    info = read_checkpoint(ckpts / "step-000002")  # intact: every file has its recorded size
    assert info.step == 2 and resolve_checkpoint(out).step == 2
    killed = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")}
    assert sorted(killed) == [1, 2, 3, 4]  # steps 3-4 ran, their checkpoint did not land

    rc, log = finish(zfctl("resume", str(out)))
    assert rc == 0, log
    recs = read_metrics(out / "metrics.jsonl", "train")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]  # the lost steps are redone, once
    assert [r["loss"] for r in recs[2:4]] == [killed[3], killed[4]]  # bit-identical redo
    assert resolve_checkpoint(out).step == 6
    assert not list(ckpts.glob(".tmp-*"))


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_143_with_resume_hint(tmp_path):
    out = tmp_path / "run"
    p = finetune(out, "train.max_steps=500", "checkpoint.every=0")
    wait_for(lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2, p)
    p.send_signal(signal.SIGTERM)
    rc, log = finish(p)
    assert rc == 143, log
    assert f"zfctl resume {out}" in log
    step = resolve_checkpoint(out).step
    assert 2 <= step < 500
    assert read_metrics(out / "metrics.jsonl", "train")[-1]["step"] == step


# finished_run: tests/conftest.py, a finished 2-step run shared with tests/e2e/test_run_safety.py


def _one_line_error(rc: int, log: str, *needles: str) -> None:
    assert rc == 2, log
    assert "Traceback" not in log, log
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    assert any(all(n in ln for n in needles) for ln in lines), log


@pytest.mark.slow
def test_bad_inputs_exit_2_and_touch_nothing(finished_run, tmp_path, monkeypatch):
    widen_consoles(monkeypatch)  # each error on one line, as COLUMNS=200 gives the process below
    before = tree_digest(finished_run)
    bad = tmp_path / "bad.jsonl"  # record 2 lacks its `output` field (records enough to fill a micro-batch)
    bad.write_text(json.dumps({"instruction": "a", "input": "", "output": "b"}) + "\n"
                   + json.dumps({"instruction": "a", "input": ""}) + "\n"
                   + (json.dumps({"instruction": "a", "input": "", "output": "b"}) + "\n") * 8)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text("{oops")
    # A rank's environment needs its own process (what a rank reads of WORLD_SIZE must not leak into
    # this one): started first, it imports while the refusals below run through the Typer app, each
    # in its pre-flight. `python -m zfctl`'s own exit path: tests/cli/test_cli.py.
    ranked = zfctl("resume", str(finished_run), env={"WORLD_SIZE": "2", "RANK": "0"})

    def cli(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        return result.exit_code, result.output

    def tune(out: Path, *extra: str, data: str = "alpaca-sample", model: str = "tiny-llama") -> tuple[int, str]:
        return cli("finetune", model, "--data", data, "--output", str(out),
                   *[a for s in [*TINY, *extra] for a in ("--set", s)])

    # (exit code and output, words the one error line must hold)
    cases = [
        (tune(finished_run, "train.max_steps=1"), ["--force"]),  # existing output
        (tune(tmp_path / "m", data=str(tmp_path / "nope.jsonl")), ["nope.jsonl"]),  # missing data file
        (tune(tmp_path / "x", "data.template=alpaca", data=str(bad)), ["bad.jsonl", "output"]),  # bad record
        (tune(tmp_path / "y", model="tiny-lama"), ["tiny-lama"]),  # unknown model
        (cli("resume", str(broken)), ["unreadable", "meta.json"]),  # unreadable checkpoint
        (finish(ranked), ["cannot resume on 2 process(es)", "--nproc 1"]),  # a world size that cannot keep
        # the global batch
    ]
    for result, needles in cases:
        _one_line_error(*result, *needles)
    assert tree_digest(finished_run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "broken"]  # no output folder made
