"""Stops and kills at the edges of a save (docs/design.md, "Failures and the run folder").

A stop that lands while a checkpoint is written makes that save the stop checkpoint (no step more
is trained) and the resume continues bit-identically; a second stop removes the save's partial
folder; a kill between a checkpoint folder's rename and the `latest` update leaves the newer,
verified checkpoint the one used, with a note; a full disk names the file it was writing.

In-process and cheap. Signals are raised inside the checkpoint writer itself: the test hook that
the subprocess tests slow down with ZFCTL_TEST_SLOW_CHECKPOINT (zfctl/train/testhooks.py) is
patched to call ``signal.raise_signal``, which runs the run's handler before it returns, so the
signal lands mid-save every time. Runs are the tiny 2-layer model for one or two steps (a
checkpoint after each); the writer's own faults use a 4x4 Linear and no training at all. One
test (slow) runs `--nproc 2`, for the ranks' agreement to stop after a save.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import widen_consoles
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import RunFailed
from zfctl.plan.resolve import resolve_plan
from zfctl.train import checkpoint as ck
from zfctl.train import checksum, resume, run
from zfctl.train.checkpoint import write
from zfctl.train.metrics import read_metrics
from zfctl.train.signals import Aborted, Interrupted, run_stop_signals
from zfctl.train.testhooks import SLOW_WRITE_ENV

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4", "data.end_idx=32",
    "data.max_length=64", "train.micro_batch_size=4", "train.eval_every=0", "train.device=cpu",
    "train.precision=fp32", "zenflow.update_interval=2", "checkpoint.every=1", "checkpoint.keep_last=3",
    "logging.every=1",
]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch, 400)


@pytest.fixture(autouse=True)
def unhandled_sigterm_fails_the_test() -> Iterator[None]:
    """A SIGTERM that no run's handler takes fails the test instead of ending pytest."""
    def fail(signum: int, frame: object) -> None:
        raise AssertionError("SIGTERM reached the test's own handler: the run did not handle it")

    before = signal.signal(signal.SIGTERM, fail)
    yield
    signal.signal(signal.SIGTERM, before)


def tiny_run(out: Path, steps: int) -> Path:
    run(resolve_plan("tiny-llama", "alpaca-sample",
                     overrides=[*TINY, f"train.max_steps={steps}", f"checkpoint.output_dir={out}"]))
    return out


def signals_in_save(monkeypatch: pytest.MonkeyPatch, at: int, *signums: int) -> None:
    """Raise ``signums`` inside the write of step ``at``'s checkpoint (after the model, optimizer
    and RNG files, before trainer.pt and meta.json); each handler has run when it returns."""
    def hook(step: int) -> None:
        if step == at:
            for s in signums:
                signal.raise_signal(s)

    monkeypatch.setattr(write, "slow_checkpoint_write", hook)


def entries(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / ck.CHECKPOINTS).iterdir())


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl", "train")}


def state_digests(info: ck.CheckpointInfo) -> dict[str, str]:
    """The digests of every file but plan.yaml (which names the run folder)."""
    return {n: d for n, d in info.meta["digests"].items() if n != ck.PLAN_FILE}


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-step run, a checkpoint after each step: what a stopped run must match."""
    return tiny_run(tmp_path_factory.mktemp("straight") / "run", 2)


# ------------------------------------------------------------------------------ a stop during a save


def test_a_stop_during_a_periodic_save_is_the_stop_checkpoint_and_the_resume_is_exact(
        straight: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    signals_in_save(monkeypatch, 1, signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped:
        tiny_run(out, 2)
    assert stopped.value.code == 143
    assert stopped.value.message.startswith("stopped by SIGTERM after step 1; checkpoint saved")
    # The save in progress became the stop checkpoint: no step 2 trained, no second save.
    assert entries(out) == ["latest", "step-000001"]
    assert (out / ck.CHECKPOINTS / ck.LATEST).read_text() == "step-000001\n"
    assert list(losses(out)) == [1]

    monkeypatch.setattr(write, "slow_checkpoint_write", lambda step: None)
    assert resume(out).steps == 2
    assert losses(out) == losses(straight)  # bit-identical
    assert state_digests(ck.resolve_checkpoint(out)) == state_digests(ck.resolve_checkpoint(straight))


def test_a_stop_during_the_final_save_finishes_it_and_exits_143(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The save after the last step is handled like the others: not the default action of the
    signal, which would end the process mid-save."""
    out = tmp_path / "run"
    signals_in_save(monkeypatch, 1, signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped:
        tiny_run(out, 1)
    assert stopped.value.code == 143 and "after step 1; checkpoint saved" in stopped.value.message
    assert entries(out) == ["latest", "step-000001"]
    assert ck.damaged_files(ck.resolve_checkpoint(out)) == []


@pytest.mark.slow
def test_a_stop_during_a_save_of_two_ranks_stops_both_after_it(tmp_path: Path) -> None:
    """Under --nproc 2 the ranks agree once the save is done (one tiny all-reduce), so both stop at
    its step. Two processes because that agreement is the claim; the step-2 save sleeps 20 s on
    rank 0 (the test hook) so that the launcher's forwarded SIGTERM lands inside it."""
    out = tmp_path / "run"
    sets = [a for s in [*TINY, "train.max_steps=4"] for a in ("--set", s)]
    log = tmp_path / "log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "zfctl", "finetune", "tiny-llama", "--data", "alpaca-sample",
                              "--output", str(out), "--nproc", "2", *sets], cwd=ROOT, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "300", SLOW_WRITE_ENV: "2:20"})
        try:
            partial = out / ck.CHECKPOINTS / ".tmp-step-000002" / ck.MODEL_FILE
            deadline = time.monotonic() + 300
            while not partial.exists():
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)  # the launcher forwards it to both ranks
            assert p.wait(300) == 143, log.read_text()
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = log.read_text()
    assert "stopped by SIGTERM after step 2; checkpoint saved" in text, text
    assert entries(out) == ["latest", "step-000001", "step-000002"] and list(losses(out)) == [1, 2]
    info = ck.resolve_checkpoint(out)
    assert info.step == 2 and info.world_size == 2 and ck.damaged_files(info) == []


# ------------------------------------------------------------------------------ a second stop during a save


def test_a_second_stop_during_a_save_removes_its_partial_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    signals_in_save(monkeypatch, 1, signal.SIGTERM, signal.SIGTERM)
    with pytest.raises(Aborted) as aborted:
        tiny_run(out, 2)
    assert aborted.value.code == 143
    assert entries(out) == []  # no .tmp-step-000001 until the next start: nothing at all
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("aborted")]
    assert lines == [f"aborted by a second SIGTERM: no checkpoint was written; {out} has none yet"]


def linear_save(root: Path, step: int, model: torch.nn.Module | None = None, **kw: object) -> Path:
    """One checkpoint of a 4x4 Linear under ``root``: the writer alone, no training."""
    torch.manual_seed(step)
    return ck.save_checkpoint(root, step, model=model or torch.nn.Linear(4, 4), optimizer_state={"x": torch.ones(2)},
                              trainer_state={"step": step}, write_plan=lambda p: p.write_text("train: {}\n"),
                              keep_last=5, **kw)  # type: ignore[arg-type]


def test_a_second_stop_with_other_writers_names_the_partial_folder_it_leaves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """Under --nproc the other ranks may still be writing into the folder: rank 0 leaves it to the
    next start (which removes it) and says so, instead of pulling it from under them."""
    linear_save(tmp_path, 1)
    signals_in_save(monkeypatch, 2, signal.SIGTERM, signal.SIGTERM)
    stop = run_stop_signals(lambda line: None, rank=0, run_dir=tmp_path, newest=lambda: 1, world_size=2,
                            abandon=lambda: ck.abandon_save(remove=False))
    with pytest.raises(Aborted), stop:
        linear_save(tmp_path, 2)
    partial = tmp_path / ck.CHECKPOINTS / ".tmp-step-000002"
    assert partial.is_dir()
    (line,) = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("aborted")]
    assert line == (f"aborted by a second SIGTERM: no checkpoint was written; the newest in {tmp_path} is step 1 "
                    f"(continue: zfctl resume {tmp_path}); its partial folder {partial} is left for the next "
                    "start to remove")


# ------------------------------------------------------------------------------ a kill between the rename and `latest`


def killed_before_latest(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """The process ends (as a SIGKILL would) right after step ``at``'s folder is renamed into place."""
    real = write._write_latest

    def write_latest(root: Path, name: str) -> None:
        if name == ck.step_name(at):
            raise SystemExit(-9)
        real(root, name)

    monkeypatch.setattr(write, "_write_latest", write_latest)


def test_a_kill_between_the_rename_and_latest_resumes_from_the_newer_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / ck.CHECKPOINTS
    linear_save(tmp_path, 1)
    killed_before_latest(monkeypatch, 2)
    with pytest.raises(SystemExit):
        linear_save(tmp_path, 2)
    assert (root / ck.LATEST).read_text() == "step-000001\n" and (root / "step-000002" / ck.META).is_file()
    notes: list[str] = []
    assert ck.resolve_checkpoint(tmp_path, notes).step == 2
    assert notes == [(f"{root / ck.LATEST} names step-000001, but step-000002 was saved after it and every file "
                      "verifies (the process ended before it moved latest); using step-000002")]
    assert ck.resolve_checkpoint(tmp_path, latest_good=True).step == 2
    # The newer one damaged: the one `latest` names, and the note says why.
    with open(root / "step-000002" / ck.MODEL_FILE, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    notes.clear()
    assert ck.resolve_checkpoint(tmp_path, notes).step == 1
    assert notes == [(f"{root / ck.LATEST} names step-000001; step-000002, saved after it, is damaged "
                      f"({ck.MODEL_FILE} does not match its digest), so step-000001 is used")]
    assert ck.resolve_checkpoint(tmp_path, latest_good=True).step == 1


def test_a_newer_checkpoint_of_an_abandoned_timeline_is_not_taken_for_one(tmp_path: Path) -> None:
    """A run resumed from step 1 replaced step 2 and moved `latest` to it; step 3 continues the
    old step 2, not this one, so `latest` is followed as it is."""
    first = linear_save(tmp_path, 1)
    linear_save(tmp_path, 2)
    linear_save(tmp_path, 3)
    linear_save(tmp_path, 2, model=torch.nn.Linear(4, 4), previous=first)  # the resumed run's first save
    notes: list[str] = []
    assert ck.resolve_checkpoint(tmp_path, notes).step == 2 and notes == []
    assert ck.resolve_checkpoint(tmp_path, latest_good=True).step == 2


def test_resume_says_it_uses_the_checkpoint_saved_after_latest(straight: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    (run_dir / ck.CHECKPOINTS / ck.LATEST).write_text("step-000001\n")  # what the kill left
    res = runner.invoke(app, ["resume", str(run_dir)])
    assert res.exit_code == 0, res.output
    assert "but step-000002 was saved after it and every file verifies" in res.stderr
    assert f"ended at step 2 ({run_dir / ck.CHECKPOINTS / 'step-000002'}); nothing to resume" in res.output


# ------------------------------------------------------------------------------ a full disk during a save


def disk_full_on(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Writes to the file ``name`` fail with ENOSPC and, as a real write() does, no file name."""
    real_init = checksum.HashingWriter.__init__

    class Full:
        def __init__(self, f: object) -> None:
            self.f = f

        def write(self, data: object) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, attr: str) -> Callable:
            return getattr(self.f, attr)

    def init(w: checksum.HashingWriter, f) -> None:
        real_init(w, Full(f) if Path(f.name).name == name else f)

    monkeypatch.setattr(checksum.HashingWriter, "__init__", init)


@pytest.mark.parametrize("name", [ck.MODEL_FILE, ck.optimizer_file(0), ck.rng_file(0), ck.TRAINER_FILE])
def test_disk_full_during_a_save_names_the_file_being_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              name: str) -> None:
    linear_save(tmp_path, 1)
    disk_full_on(monkeypatch, name)
    with pytest.raises(RunFailed) as failed:
        linear_save(tmp_path, 2)
    partial = tmp_path / ck.CHECKPOINTS / ".tmp-step-000002"
    assert str(failed.value).startswith(f"cannot write the checkpoint of step 2: No space left on device (errno 28) "
                                        f"at {partial / name}; the partial folder was removed; ")
    assert entries(tmp_path) == ["latest", "step-000001"]
