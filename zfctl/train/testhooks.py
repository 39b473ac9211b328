"""Fault injection for the test suite: environment variables that make a run fail on purpose.

For tests only. Each hook is one variable, read where the fault must happen; unset (always, in
real use) it costs one ``os.environ`` lookup and does nothing. They exist so that tests can put
a failure at an exact point of a real multi-process run, where a monkeypatch cannot reach (the
ranks are separate processes started by torchrun).
"""

from __future__ import annotations

import os
import time

from zfctl.errors import RunFailed

# "RANK:STEP": rank RANK raises RunFailed during optimizer step STEP, after its backward and
# before optimizer.step()'s collectives (where its peers then wait), so tests can check that one
# failing rank ends the whole job (tests/e2e/test_failures.py).
FAIL_ENV = "ZFCTL_TEST_FAIL_STEP"
# "RANK:STEP": rank RANK stops answering (sleeps for good) at the same point: a rank that hangs
# without dying, for distributed.timeout (tests/e2e/test_failures.py).
HANG_ENV = "ZFCTL_TEST_HANG_STEP"
# "STEP:SECONDS": sleep inside the write of that step's checkpoint (after the model file, before
# meta.json), so a test can SIGKILL or signal the process mid-write deterministically
# (tests/cli/test_train_cli.py, tests/e2e/test_run_safety.py).
SLOW_WRITE_ENV = "ZFCTL_TEST_SLOW_CHECKPOINT"
# "SECONDS": a rank whose run failed sleeps that long before it tears down (and before its error
# line), as a loaded machine may be that slow there: torchrun's SIGTERM to the survivors of a
# dead rank then lands inside that window (tests/e2e/test_failures.py).
SLOW_TEARDOWN_ENV = "ZFCTL_TEST_SLOW_TEARDOWN"


def fail_or_hang(rank: int, step: int) -> None:
    """:data:`FAIL_ENV` / :data:`HANG_ENV`, called by the loop between backward and optimizer step."""
    spec = os.environ.get(FAIL_ENV)
    if spec and spec.split(":") == [str(rank), str(step)]:
        raise RunFailed(f"step {step}: failure injected by {FAIL_ENV}={spec} (a test hook)")
    if os.environ.get(HANG_ENV, "").split(":") == [str(rank), str(step)]:
        while True:
            time.sleep(1)


def slow_checkpoint_write(step: int) -> None:
    """:data:`SLOW_WRITE_ENV`, called by the checkpoint writer between two files of step ``step``."""
    spec = os.environ.get(SLOW_WRITE_ENV)
    if spec:
        at, _, seconds = spec.partition(":")
        if int(at) == step:
            time.sleep(float(seconds or 30))


def slow_teardown() -> None:
    """:data:`SLOW_TEARDOWN_ENV`, called as a failed run starts its teardown (zfctl/train/recipe.py)."""
    spec = os.environ.get(SLOW_TEARDOWN_ENV)
    if spec:
        time.sleep(float(spec))
