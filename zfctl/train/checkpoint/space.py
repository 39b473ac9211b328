"""Disk space for checkpoints: refuse a save that cannot fit before it starts, not halfway through.

Before a run and before each save, the free space is compared with one checkpoint's size: the
newest listed checkpoint's (a resumed run, every save after the first) or :func:`estimate_bytes`
(the first of a fresh run). Folders a killed process left (``.tmp-*``, ``.trash-*``) are removed
first, so they do not count against the run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from zfctl.errors import UserError
from zfctl.train.checkpoint.find import newest_listed
from zfctl.train.checkpoint.format import CHECKPOINTS

# Optimizer-state bytes per trainable parameter in a checkpoint, for the free-space check before
# the first save: fp32 master + two moments + the host gradient accumulator (16 B) plus the
# device-side copies of the selected columns (~1 B at topk 0.1). Measured 17.0 on tiny-llama.
OPTIMIZER_BYTES_PER_PARAM = 17


def clean_stale(root: Path) -> list[Path]:
    """Remove what a killed process left half-written in ``root`` (a run folder or its
    ``checkpoints/``): ``.tmp-*`` / ``.trash-*`` checkpoint folders, and the temporary files of
    atomic writes (``.latest.<pid>.<hex>.tmp``, ``.plan.yaml.<pid>.<hex>.tmp``: zfctl/plan/io.py
    ``atomic_write_text``; ``metrics.jsonl.tmp`` of older versions). None is ever read; only
    the holder of the folder's lock may remove them (one may be a live run's write)."""
    removed = []
    if root.is_dir():
        for stale in sorted(root.iterdir()):
            name = stale.name
            if stale.is_dir() and not stale.is_symlink() and name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(stale, ignore_errors=True)
            elif stale.is_file() and ((name.startswith(".") and name.endswith(".tmp")) or name == "metrics.jsonl.tmp"):
                stale.unlink(missing_ok=True)
            else:
                continue
            removed.append(stale)
    return removed


def estimate_bytes(model: torch.nn.Module) -> int:
    """Expected checkpoint size before the first save: the weights + the optimizer state.

    Under FSDP2 (``model`` sharded) the same total: a DTensor's ``numel`` is the whole tensor's,
    and the ranks' model and optimizer files together hold every element once (shards.py)."""
    seen, weights = set(), 0
    for t in model.state_dict().values():
        # tied tensors are stored once: the same memory (a DTensor's: its local shard's)
        key = (t.to_local() if isinstance(t, DTensor) else t).data_ptr()
        if key not in seen:
            seen.add(key)
            weights += t.numel() * t.element_size()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return weights + OPTIMIZER_BYTES_PER_PARAM * trainable


def last_size(root: Path) -> int:
    """Bytes of the newest listed checkpoint under ``root`` (0 if none): the next save's size."""
    info = newest_listed(root)
    return sum(int(v) for v in info.meta["files"].values()) if info else 0


def check_run_space(out: Path, estimate: int, *, reclaim: bool = False, clean: bool = True) -> None:
    """Before a run: clean what a killed process left half-written (:func:`clean_stale`, in the
    run folder and its ``checkpoints/``), refuse if one checkpoint cannot fit.

    The size is the newest checkpoint's (a resumed run) or ``estimate``. ``reclaim`` (``--force``
    over an old run folder): the checkpoints about to be deleted count as free. ``clean`` only
    under the run folder's lock: without it a ``.tmp-*`` may be a live run's save in progress.
    """
    root = Path(out) / CHECKPOINTS
    if clean:
        clean_stale(root)
        clean_stale(Path(out))
    needed = last_size(root) or estimate
    if reclaim and root.is_dir():
        needed -= sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    check_free_space(out, needed)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def check_free_space(folder: Path, needed: int, *, when: str = "") -> None:
    """Refuse with one line when ``folder``'s file system has less than ``needed`` bytes free."""
    probe = Path(folder).absolute()
    while not probe.exists():  # the run folder may not exist yet: measure where it will be made
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        when = f" ({when})" if when else ""
        raise UserError(f"not enough disk space for a checkpoint{when}: needs {_fmt_bytes(needed)}, "
                        f"{_fmt_bytes(free)} free at {probe}; free some space or choose another --output")
