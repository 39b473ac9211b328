"""One failing rank ends the whole job: 2 gloo ranks through the real ``--nproc 2`` launcher.

A rank that raises mid-step (the loop's test hook, zfctl/train/testhooks.py ``FAIL_ENV``) and a rank
that is SIGKILLed mid-run must each end every process of the job within seconds (30 s allowed on a
loaded box; the job's start-up, most of each test, is not counted), with a non-zero
exit, the failing rank's own one-line error (or torchrun naming the killed rank), no traceback
from the survivor blocked in a collective, and no half-written checkpoint counted as one.
A rank that hangs (``HANG_ENV``) ends the job under ``distributed.timeout`` with one line naming
it, and a SIGKILLed launcher leaves no process of its job behind (checked in /proc).
Polls for conditions, never fixed sleeps: the machine may be a loaded 2-core box.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from proc_helpers import alive, children, metric_steps

from zfctl.train.checkpoint import damaged_files, read_checkpoint, resolve_checkpoint
from zfctl.train.dist import TIMEOUT_EXIT
from zfctl.train.testhooks import FAIL_ENV, HANG_ENV, SLOW_TEARDOWN_ENV

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=96", "data.max_length=64", "train.eval_batches=2", "train.eval_every=0",
    "train.device=cpu", "train.precision=fp32", "logging.every=1", "zenflow.topk_ratio=0.1",
    "zenflow.update_interval=2", "zenflow.cpu_threads=1", "train.micro_batch_size=2",
    "train.max_steps=100000", "checkpoint.every=1",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


class Job:
    """``zfctl finetune --nproc 2`` in its own session; merged output collected by a thread."""

    def __init__(self, out: Path, env: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> None:
        sets = [a for s in [*TINY, *extra] for a in ("--set", s)]
        cmd = [sys.executable, "-m", "zfctl", "finetune", "tiny-llama", "--data", "alpaca-sample",
               "--output", str(out), "--nproc", "2", *sets]
        self.p = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env={**ENV, **(env or {})}, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.p.stdout or []), daemon=True)
        self._reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float = 150) -> None:
        t0 = time.monotonic()
        while not cond():
            assert self.p.poll() is None, f"ended early (rc {self.p.returncode}) waiting for {what}:\n{self.out}"
            if time.monotonic() - t0 > timeout:
                os.killpg(self.p.pid, signal.SIGKILL)
                raise AssertionError(f"timed out waiting for {what}:\n{self.out}")
            time.sleep(0.05)

    def finish(self, timeout: float) -> int:
        """The launcher's exit code; fails (and kills the job) if it takes longer than ``timeout``."""
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            raise AssertionError(f"the job did not end within {timeout} s:\n{self.out}") from None
        finally:
            self._reader.join(10)
def rank_pids(job: Job) -> dict[int, int]:
    """{rank: pid} of the workers (children of torchrun, the launcher's child)."""
    out = {}
    for pid in [w for t in children(job.p.pid) for w in children(t)]:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                out[int(kv[5:])] = pid
    return out

def assert_checkpoints_whole(run: Path) -> int:
    """Every ``step-*`` folder verifies and ``latest`` resolves; returns the newest step."""
    root = run / "checkpoints"
    steps = sorted(root.glob("step-*"))
    assert steps, "no checkpoint at all"
    for path in steps:
        assert not damaged_files(read_checkpoint(path)), path  # raises on a missing meta or file
    return resolve_checkpoint(run).step


@pytest.mark.slow
def test_a_rank_raising_mid_step_ends_every_rank_with_its_one_line_error(tmp_path):
    run = tmp_path / "run"
    job = Job(run, env={FAIL_ENV: "1:3"})
    job.wait_for(lambda: len(rank_pids(job)) == 2, "both ranks")
    ranks = rank_pids(job)
    t0 = time.monotonic()
    while "failure injected" not in job.out and job.p.poll() is None and time.monotonic() - t0 < 150:
        time.sleep(0.05)
    t0 = time.monotonic()  # the failing rank has printed its error: from here the job must end
    rc = job.finish(timeout=30)
    print(f"job ended {time.monotonic() - t0:.1f} s after the failing rank's error")  # pytest -s
    log = job.out
    assert rc == 1, log
    assert "Traceback" not in log and "ChildFailedError" not in log, log
    errors = [ln for ln in log.splitlines() if ln.startswith("error:")]
    assert f"error: rank 1: step 3: failure injected by {FAIL_ENV}=1:3 (a test hook)" in errors, log
    # rank 0 was waiting for rank 1 in the gradient all-reduce: one line, not a traceback
    assert all(e.startswith(("error: rank 1: step 3", "error: rank 0: stopped because another")) for e in errors), log
    assert not any(alive(pid) for pid in ranks.values()), log
    assert metric_steps(run) == [1, 2]
    assert assert_checkpoints_whole(run) == 2


@pytest.mark.slow
def test_a_sigkilled_rank_ends_the_job_within_seconds_and_leaves_whole_checkpoints(tmp_path):
    run = tmp_path / "run"
    job = Job(run)
    job.wait_for(lambda: (run / "checkpoints/latest").exists() and len(rank_pids(job)) == 2,
                 "a first checkpoint, both ranks training")
    ranks = rank_pids(job)
    os.kill(ranks[1], signal.SIGKILL)  # wherever it is: computing, in a collective, mid-checkpoint
    t0 = time.monotonic()
    rc = job.finish(timeout=30)
    print(f"job ended {time.monotonic() - t0:.1f} s after the SIGKILL")  # pytest -s
    log = job.out
    assert rc == 137, log  # 128 + SIGKILL: the killed rank's code, not the survivor's
    assert "Traceback" not in log and "ChildFailedError" not in log, log
    assert not any(alive(pid) for pid in ranks.values()), log
    newest = assert_checkpoints_whole(run)
    assert newest >= 1
    # the launcher names the killed rank and, since it could not, says where to continue from
    assert (f"error: rank 1 exited with code 137; once that is fixed, continue from its checkpoint of step "
            f"{newest} with `zfctl resume {run}`") in log.splitlines(), log
    # The survivor (if torchrun's shutdown let it say anything) names the real run folder and the
    # step a resume continues from, and corrects a stop it announced on torchrun's SIGTERM.
    survivor = [ln for ln in log.splitlines() if ln.startswith("error: rank 0:")]
    for line in survivor:
        assert line.endswith(f"continue from its checkpoint of step {newest} with `zfctl resume {run}`"), line
    if "stop requested" in log:
        assert any("the stop checkpoint was not written" in line for line in survivor), log


@pytest.mark.slow
def test_a_stop_that_a_dead_peer_prevents_is_corrected_in_the_survivors_error(tmp_path):
    # What torchrun does when a rank dies (SIGTERM to the survivors), made certain: rank 0 gets the
    # SIGTERM as rank 1 is SIGKILLed, announces its stop checkpoint, and cannot write it.
    # torchrun's own SIGTERM follows within ~0.2 s. SLOW_TEARDOWN_ENV makes rank 0's teardown as
    # slow as a loaded box can (1 s), so that signal always lands before rank 0's error line is
    # out: the line must come all the same (zfctl/train/signals.py, hold_signals).
    run = tmp_path / "run"
    job = Job(run, env={SLOW_TEARDOWN_ENV: "1"})
    job.wait_for(lambda: (run / "checkpoints/latest").exists() and len(rank_pids(job)) == 2,
                 "a first checkpoint, both ranks training")
    ranks = rank_pids(job)
    os.kill(ranks[0], signal.SIGTERM)
    os.kill(ranks[1], signal.SIGKILL)
    assert job.finish(timeout=30) == 137
    log = job.out
    newest = assert_checkpoints_whole(run)
    resume = f"continue from its checkpoint of step {newest} with `zfctl resume {run}`"
    assert "stop requested: finishing this step and writing a checkpoint" in log, log
    assert "Traceback" not in log and "pair.cc" not in log, log
    assert f"error: rank 1 exited with code 137; once that is fixed, {resume}" in log.splitlines(), log
    said = [ln for ln in log.splitlines() if ln.startswith(("error: rank 0:", "aborted by a second"))]
    assert len(said) == 1, log
    line = said[0]
    if line.startswith("aborted"):
        # torchrun's SIGTERM reached rank 0 while it was still computing, before a collective had
        # told it of the dead peer: a second signal, which no rank can tell from the user's own
        # second Ctrl-C (its sender is not known to a Python handler), so it aborts as that does,
        # naming the newest checkpoint. Rare: rank 0 is usually in a collective already.
        print("rank 0 aborted on torchrun's SIGTERM before its collective failed")  # pytest -s
        assert line == (f"aborted by a second SIGTERM: no checkpoint was written; the newest in {run} "
                        f"is step {newest} (continue: zfctl resume {run})"), log
        return
    assert line.startswith("error: rank 0: the stop checkpoint was not written: another process of this job "
                           "ended first"), log
    assert line.endswith(resume), log


@pytest.mark.slow
def test_a_sigkilled_launcher_leaves_no_process_of_its_job(tmp_path):
    run = tmp_path / "run"
    job = Job(run)
    job.wait_for(lambda: len(rank_pids(job)) == 2 and metric_steps(run), "both ranks training")
    ranks = rank_pids(job)
    torchrun = children(job.p.pid)
    assert len(torchrun) == 1 and all(alive(p) for p in [*torchrun, *ranks.values()])
    os.kill(job.p.pid, signal.SIGKILL)  # no handler runs: the kernel has to take the rest down
    job.p.wait(30)
    left = [*torchrun, *ranks.values()]
    t0 = time.monotonic()
    while any(alive(p) for p in left) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    survivors = [p for p in left if alive(p)]
    for pid in survivors:  # a failing run must not leave them training on the shared box
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"still running: {survivors}\n{job.out}"


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_under_distributed_timeout_with_one_line_naming_it(tmp_path):
    run = tmp_path / "run"
    job = Job(run, env={HANG_ENV: "1:3"}, extra=("distributed.timeout=20",))
    job.wait_for(lambda: len(rank_pids(job)) == 2, "both ranks")
    ranks = rank_pids(job)
    job.wait_for(lambda: metric_steps(run)[-1:] == [2], "step 2, before rank 1 stops answering")
    # rank 1 sleeps before step 3's collectives; rank 0 waits 20 s, names it, and torchrun's
    # shutdown then SIGKILLs the sleeper (after its 30 s grace): 50 s and start-up, 180 allowed
    rc = job.finish(timeout=180)
    log = job.out
    assert rc == TIMEOUT_EXIT, log
    assert "Traceback" not in log, log
    errors = [ln for ln in log.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: rank 0: rank 1 did not answer within distributed.timeout=20 s"), log
    assert not any(alive(pid) for pid in ranks.values()), log
    assert metric_steps(run) == [1, 2] and assert_checkpoints_whole(run) == 2
