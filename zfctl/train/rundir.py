"""The run folder's rules: what `--force` may replace, and what counts as a changed plan.

A run folder holds ``checkpoints/``, ``metrics.jsonl``, ``plan.yaml``, optional logger folders
and, while a process works in it, ``.zfctl.lock`` (``zfctl.train.lock``). ``--force`` replaces
exactly those (never the lock) and never empties a folder zfctl did not make, nor one a live run
holds (the caller takes the lock first).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from zfctl.errors import UserError
from zfctl.plan.schema import RunPlan
from zfctl.train.checkpoint import CHECKPOINTS, PLAN_FILE
from zfctl.train.lock import LOCK_FILE
from zfctl.train.metrics import METRICS_FILE, TENSORBOARD_DIR, WANDB_DIR

# What `--force` may delete in an existing run folder; anything else there is left alone.
RUN_ENTRIES = (CHECKPOINTS, METRICS_FILE, PLAN_FILE, TENSORBOARD_DIR, WANDB_DIR)
# Plan keys that may differ between a checkpoint and the run folder without being a "change": the
# machine section says what the memory estimate is checked against, not what is trained.
RESUME_FREE_KEYS = ("checkpoint.output_dir", "train.max_steps", "machine.gpu_memory", "machine.host_memory")


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an existing, non-empty output folder unless ``force`` (and then only a run folder)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"output {out} exists and is not a folder; choose another --output")
    entries = {p.name for p in out.iterdir()} - {LOCK_FILE}  # a stale lock alone: still empty
    if not entries:
        return
    if not force:
        raise UserError(f"output folder {out} already exists and is not empty; pass --force to "
                        f"overwrite it, `zfctl resume {out}` to continue it, or choose another --output")
    if not entries & set(RUN_ENTRIES):
        raise UserError(f"output folder {out} is not empty and is not a zfctl run folder; --force only "
                        "overwrites run folders: choose a new or empty --output")


def clear_run_dir(out: Path) -> None:
    for name in RUN_ENTRIES:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def plan_differences(old: RunPlan, new: RunPlan, ignore: tuple[str, ...] = RESUME_FREE_KEYS) -> list[str]:
    """Dotted keys whose values differ, as ``key: old -> new``."""
    def flat(d: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and prefix == "":
                out.update(flat(v, key + "."))
            else:
                out[key] = list(v) if isinstance(v, tuple) else v
        return out

    a, b = flat(asdict(old)), flat(asdict(new))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k not in ignore and a.get(k) != b.get(k)]
