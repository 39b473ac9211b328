"""Shared pieces for the tests that run whole jobs as processes: the process tree, a run's steps, ranks
spawned in-process, and run folders shared between tests."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from zfctl.train.metrics import read_metrics


def children(pid: int) -> list[int]:
    """The child pids of ``pid`` (all its threads' children), [] once it is gone."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent's wait() does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def metric_steps(run: Path) -> list[int]:
    """The steps of the train records in ``run``'s metrics.jsonl ([] before the first)."""
    path = run / "metrics.jsonl"
    return [r["step"] for r in read_metrics(path, "train")] if path.exists() else []


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op torch thread inside the block (restored after), as each torchrun rank runs
    (OMP_NUM_THREADS=1): on the loaded 2-core box two threads run tiny-llama's steps several times
    slower. For module fixtures, which the function-scoped ``one_torch_thread`` (tests/conftest.py)
    does not reach: a run read by tests that compare bytes with their own runs takes the same count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def rendezvous(folder: Path) -> str:
    """A ``file://`` init_method in ``folder`` for the ranks of one test. A file, not a TCP port:
    a port picked free here could be taken by another process before rank 0 binds it."""
    return f"file://{Path(folder).resolve() / 'rendezvous'}"


def _leave_after(rank: int, worker: Callable[..., None], *args: object) -> None:
    """``worker(rank, *args)``, then leave at once: torch 2.13 aborts at interpreter exit after
    ``destroy_process_group`` in about one spawned rank in three under load ("terminate called
    without an active exception", SIGABRT), after the results are on disk. A worker that raises
    propagates as before (spawn reports its traceback)."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(worker: Callable[..., None], nprocs: int, args: tuple, *, timeout: float, what: str) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` processes and wait for all of them; past
    ``timeout`` seconds kill them and fail the test with ``what`` (a hang is mismatched collectives).
    Each rank leaves with ``os._exit`` once its worker returned (``_leave_after``)."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(_leave_after, args=(worker, *args), nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} did not finish within {timeout:.0f} s")


_SHARED: dict[tuple[Path, str], Path | BaseException] = {}


def shared_run(factory: pytest.TempPathFactory, key: str, make: Callable[[Path], None]) -> Path:
    """The run folder ``make(folder)`` writes, made once per test session (once per pytest-xdist
    worker) and handed to every test, in any module, that asks for ``key``: one reference run read
    by several modules instead of one per module. Tests read it and copy it (shutil.copytree)
    where they write. A ``make`` that failed fails every later caller the same way, without
    running again."""
    at = (factory.getbasetemp(), key)
    if at not in _SHARED:
        out = factory.mktemp(key) / "run"
        try:
            make(out)
            _SHARED[at] = out
        except BaseException as e:
            _SHARED[at] = e
            raise
    got = _SHARED[at]
    if isinstance(got, BaseException):
        raise got
    return got
