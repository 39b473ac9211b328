"""The run folder: the one gate a run passes to write it, what `--force` may replace, and what
counts as a changed plan.

A run folder holds ``checkpoints/``, ``metrics.jsonl``, ``plan.yaml``, optional logger folders
and, while a process works in it, ``.zfctl.lock`` (``zfctl.train.lock``). ``--force`` replaces
exactly those (never the lock) and never empties a folder zfctl did not make, nor one a live run
holds (the folder is checked again under the lock).

Every verb that writes a run goes through :class:`RunFolder`: :meth:`~RunFolder.check` before
the work (the CLI's pre-flight, the ``--nproc`` launcher, each run's start), touching nothing;
:meth:`~RunFolder.claim` once every input is proved good, which makes the folder the run's.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zfctl.errors import UserError
from zfctl.plan.schema import RunPlan
from zfctl.train.checkpoint import CHECKPOINTS, PLAN_FILE, check_run_space
from zfctl.train.lock import LOCK_FILE, FolderLock, check_free
from zfctl.train.metrics import METRICS_FILE, TENSORBOARD_DIR, WANDB_DIR
from zfctl.writable import check_writable

# What `--force` may delete in an existing run folder; anything else there is left alone.
RUN_ENTRIES = (CHECKPOINTS, METRICS_FILE, PLAN_FILE, TENSORBOARD_DIR, WANDB_DIR)
# Plan keys that may differ between a checkpoint and the run folder without being a "change": the
# machine section says what the memory estimate is checked against, not what is trained.
RESUME_FREE_KEYS = ("checkpoint.output_dir", "train.max_steps", "machine.gpu_memory", "machine.host_memory")


@dataclass(frozen=True)
class RunFolder:
    """The folder a run writes. ``fresh``: a new run (``finetune``), which needs the folder absent,
    empty, or a run folder to replace with ``force``; otherwise a resumed run, which continues in
    its own folder (the one of the checkpoint's run)."""

    path: Path
    fresh: bool = True
    force: bool = False

    def check(self) -> None:
        """Refuse now, touching nothing, what :meth:`claim` would refuse later: the folder's
        contents (a fresh run), a live run holding it, a place this process cannot write."""
        if self.fresh:
            check_output_dir(self.path, self.force)
        check_free(self.path)  # a live run there: refused before anything else looks inside
        if self.fresh:
            check_writable(self.path, "--output")
        else:
            check_writable(self.path, "CKPT_DIR", "resume needs to write checkpoints and metrics there")

    def check_space(self, estimate: int) -> None:
        """Refuse a disk that cannot hold one checkpoint of ``estimate`` bytes (the newest
        checkpoint's size counts instead when the folder has one). Nothing is cleaned: without
        the lock a ``.tmp-*`` folder may be a live run's save in progress."""
        check_run_space(self.path, estimate, reclaim=self.fresh and self.force, clean=False)

    def hold(self, lock: FolderLock) -> None:
        """Take the folder's lock now if the folder exists, and keep it through data preparation:
        no other run starts in it meanwhile. A folder that does not exist yet is locked by
        :meth:`claim` as it is created. Only rank 0 locks."""
        if self.path.is_dir():
            lock.take(self.path)

    def claim(self, lock: FolderLock, *, estimate: int) -> None:
        """Make the folder this run's (rank 0, once every input is proved good).

        First the disk: a checkpoint of ``estimate`` bytes (or the newest checkpoint's) that
        cannot fit is refused now, not after an hour of training. Then the lock, held from here
        (or from :meth:`hold`) to the end: ``--force`` never clears, and no second process
        writes into, a folder a live run holds. A fresh run's folder is checked again under the
        lock and its old run's entries are removed.
        """
        check_run_space(self.path, estimate, reclaim=self.fresh and self.force)
        if self.fresh:
            check_output_dir(self.path, self.force)
        self.path.mkdir(parents=True, exist_ok=True)
        lock.take(self.path)
        if self.fresh:
            check_output_dir(self.path, self.force)  # again, under the lock
            clear_run_dir(self.path)


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
        from zfctl.train.checkpoint import newest_listed

        if PLAN_FILE in entries and newest_listed(out / CHECKPOINTS) is None:  # nothing there to resume
            raise UserError(f"output folder {out} holds a run that stopped before its first checkpoint, so there "
                            "is nothing to resume; pass --force to start it again there (it replaces the "
                            "folder's contents), or choose another --output")
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


NESTED_SECTIONS = ("zenflow.tuning",)  # dataclass sections inside sections (zfctl/offload/config.py)


def plan_differences(old: RunPlan, new: RunPlan, ignore: tuple[str, ...] = RESUME_FREE_KEYS) -> list[str]:
    """Dotted keys whose values differ, as ``key: old -> new`` (sections and nested sections such
    as ``zenflow.tuning`` by key; free-form dicts such as ``model.config`` as one value)."""
    def flat(d: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and (prefix == "" or key in NESTED_SECTIONS):
                out.update(flat(v, key + "."))
            else:
                out[key] = list(v) if isinstance(v, tuple) else v
        return out

    a, b = flat(asdict(old)), flat(asdict(new))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k not in ignore and a.get(k) != b.get(k)]
