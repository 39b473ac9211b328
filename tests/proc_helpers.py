"""Shared pieces for the tests that run whole jobs as processes: the process tree and a run's steps."""

from __future__ import annotations

import os
from pathlib import Path

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
