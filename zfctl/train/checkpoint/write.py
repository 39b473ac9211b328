"""Writing a checkpoint: the multi-rank save protocol, atomic installation, ``latest``, rotation.

Atomicity: everything is written into ``checkpoints/.tmp-step-XXXXXX/``, each file fsynced, then
the folder is renamed into place and the parent fsynced; only then does ``latest`` (a one-line
text file, replaced atomically) move. A process killed at any point leaves either the old state
or the new one: a ``.tmp-*`` folder is never read and is cleared by the next start or save.

Every file is hashed while it is written (``zfctl.train.checksum``). Model weights holding
NaN/inf are never written, and rotation runs only once the new checkpoint is installed and its
listing re-read, so keep-last-K cannot delete the last good checkpoint in favour of a bad one.
Any ``OSError`` while writing becomes one line with the errno's meaning and the file it was
writing (a failed ``write()`` or ``fsync()`` names none), and the ``.tmp-*`` folder is removed.

``meta.json`` gives each checkpoint a random ``id`` and records in ``follows`` the ``id`` of the
run's previous checkpoint (the one it resumed from or last saved), so that a checkpoint installed
by a process killed before it moved ``latest`` can be told from a newer checkpoint of an
abandoned timeline (find.py, ``resolve_checkpoint``). A second stop signal ends the process
wherever it is; :func:`abandon_save`, called from its handler, removes the partial folder of the
save in progress and says whether that save was already installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import torch

from zfctl import __version__
from zfctl.errors import RunFailed, UserError
from zfctl.plan.io import atomic_write_text
from zfctl.train.checkpoint.find import latest_target, read_checkpoint, resolve_checkpoint, step_dirs
from zfctl.train.checkpoint.format import (
    CHECKPOINTS,
    ID_KEY,
    LATEST,
    META,
    MODEL_FILE,
    PLAN_FILE,
    PREVIOUS_KEY,
    TRAINER_FILE,
    CheckpointInfo,
    model_shard_file,
    optimizer_file,
    rng_file,
    step_name,
)
from zfctl.train.checkpoint.rng import capture_rng
from zfctl.train.checkpoint.space import check_free_space, clean_stale, last_size
from zfctl.train.checksum import (
    HASH_NAME,
    NonFiniteTensorError,
    file_digest,
    save_model_hashed,
    save_torch_hashed,
)
from zfctl.train.tensorfile import save_state_hashed
from zfctl.train.testhooks import slow_checkpoint_write

T = TypeVar("T")


@dataclass
class _Save:
    """The save rank 0 of this process is writing (:func:`abandon_save`)."""

    step: int
    tmp: Path
    final: Path
    id: str


_in_progress: _Save | None = None


@contextlib.contextmanager
def _tracked(save: _Save | None) -> Iterator[str]:
    """Record ``save`` (rank 0's; None elsewhere) as this process's save in progress while the
    block runs; yields its id."""
    global _in_progress
    _in_progress = save
    try:
        yield save.id if save is not None else ""
    finally:
        _in_progress = None


class Abandoned(NamedTuple):
    """What :func:`abandon_save` found: ``installed``, the step of the save in progress when its
    folder was already renamed into place (a complete checkpoint); ``left``, its partial folder
    when it is still on disk."""

    installed: int | None
    left: Path | None


def abandon_save(*, remove: bool) -> Abandoned:
    """For the handler of a second stop signal, which ends the process wherever it is: what
    becomes of the save in progress in this process (rank 0's; nothing elsewhere). ``remove``:
    delete its partial folder now (when this process is its only writer; a ``.tmp-*`` folder is
    never read, so this is safe at any point of the save), else it is left to the next start.

    Installed is read from the disk, not from a flag that a signal could land before: the final
    folder holds a ``meta.json`` with this save's ``id``."""
    save = _in_progress
    if save is None:
        return Abandoned(None, None)
    if remove:
        shutil.rmtree(save.tmp, ignore_errors=True)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads((save.final / META).read_text(encoding="utf-8")).get(ID_KEY) == save.id:
            return Abandoned(save.step, None)
    return Abandoned(None, save.tmp if save.tmp.exists() else None)


def save_checkpoint(run_dir: Path, step: int, *, model: torch.nn.Module, optimizer_state: dict,
                    trainer_state: dict, write_plan: Callable[[Path], None], keep_last: int,
                    rank: int = 0, world_size: int = 1,
                    barrier: Callable[[], None] = lambda: None, estimate: int = 0,
                    previous: Path | None | Literal["latest"] = "latest", strategy: str = "zero2",
                    shard: tuple[int, int] | None = None) -> Path:
    """Write ``run_dir/checkpoints/step-XXXXXX`` atomically; every rank calls this.

    Rank 0 writes the model, the trainer state, the plan and meta.json, renames the folder into
    place, moves ``latest`` and rotates old checkpoints; every rank writes its own optimizer and
    RNG files. ``strategy`` ``fsdp`` (``model`` sharded by FSDP2): every rank writes its own
    shard of the model instead (``model-rankRRRRR.safetensors``, zfctl/train/checkpoint/shards.py),
    so no rank ever gathers the whole model; meta.json records the strategy. ``shard``: this
    rank's (rank, size) in FSDP2's shard group (None: the world's). Under HSDP every replica holds
    the same shards and optimizer state, so only the first replica (global ranks ``0..size-1``,
    torchrun's rank order) writes model and optimizer files, as shard ``rank`` of ``size``, and
    meta.json records ``shard_world`` = size (``CheckpointInfo.shard_world``: a reader re-cuts it
    as an fsdp checkpoint of that many ranks); every rank still writes its RNG state and takes
    every barrier. ``barrier`` must synchronise all ranks (a no-op for one process). ``estimate``:
    the expected size in bytes when no earlier checkpoint says it (see ``estimate_bytes``).
    ``previous``: the run's own newest checkpoint (None: it has none yet), which a failed save
    names as the way back; "latest": whatever ``latest`` names. They differ after a resume from
    an older checkpoint: until this run's first save, ``latest`` still names the abandoned
    timeline's newer checkpoint, which is not this run's past.

    Raises :class:`RunFailed` (nothing installed, ``.tmp-*`` removed) when the disk lacks the
    space, a write fails, or the model weights hold NaN/inf.
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / step_name(step)
    tmp = root / f".tmp-{step_name(step)}"
    with _tracked(_Save(step, tmp, final, uuid.uuid4().hex) if rank == 0 else None) as ident:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            clean_stale(root)
        barrier()  # stale folders are gone before any rank measures the free space
        # Every rank checks the same numbers, so all refuse together instead of some waiting in a
        # barrier for a rank that stopped.
        try:
            check_free_space(root, last_size(root) or estimate, when=f"before the checkpoint of step {step}")
        except UserError as e:
            raise RunFailed(f"{e}; {_last_good(root, previous)}") from None
        if rank == 0:
            tmp.mkdir()
        barrier()  # tmp exists before any rank writes into it

        shard_rank, shard_world = shard if shard is not None else (rank, world_size)
        # HSDP: the first replica's ranks are shard ranks 0..shard_world-1; the others hold copies.
        writes_state = rank == shard_rank
        digests: dict[str, str] = {}
        try:
            # The model first: its NaN check refuses the save before the optimizer state is written.
            if strategy == "fsdp" and writes_state:  # this rank's rows of every weight; rank 0's adds the unsharded tensors
                from zfctl.train.checkpoint.shards import save_model_shard

                name = model_shard_file(rank)
                digests[name] = _naming(tmp / name, lambda p: save_model_shard(model, p, step=step, rank=shard_rank,
                                                                               world=shard_world))
            elif rank == 0:
                digests[MODEL_FILE] = _naming(tmp / MODEL_FILE, lambda p: save_model_hashed(
                    model, p, {"format": "pt", "step": str(step)}))
            # Streamed from the live state: no copy of it in memory (tensorfile.py).
            if writes_state:
                name = optimizer_file(rank)
                digests[name] = _naming(tmp / name, lambda p: save_state_hashed(optimizer_state, p))
            digests[rng_file(rank)] = _naming(tmp / rng_file(rank), lambda p: save_torch_hashed(capture_rng(), p))
            if rank == 0:
                slow_checkpoint_write(step)
                digests[TRAINER_FILE] = _naming(tmp / TRAINER_FILE, lambda p: save_torch_hashed(trainer_state, p))
                write_plan(tmp / PLAN_FILE)  # an atomic write: its errors name the file
                digests[PLAN_FILE] = file_digest(tmp / PLAN_FILE)  # a few KB: hashed by reading it back
            else:  # rank 0 collects every rank's digests for meta.json
                _naming(tmp / _digest_file(rank), lambda p: _write_json(p, digests))
        except (OSError, NonFiniteTensorError) as e:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise _save_failed(e, step, root, rank, previous) from None
        barrier()  # every rank's files are durable

        if rank == 0:
            try:
                for r in range(1, world_size):
                    part = tmp / _digest_file(r)
                    digests.update(json.loads(part.read_text(encoding="utf-8")))
                    part.unlink()
                files = {name: (tmp / name).stat().st_size for name in sorted(digests)}
                hsdp = {"shard_world": shard_world} if shard_world != world_size else {}
                follows = _previous_id(root, previous)
                meta = {"zfctl_version": __version__, "step": step, "world_size": world_size, "strategy": strategy,
                        **hsdp, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), ID_KEY: ident,
                        **({PREVIOUS_KEY: follows} if follows else {}), "files": files,
                        "hash": HASH_NAME, "digests": {n: digests[n] for n in sorted(digests)}}
                _naming(tmp / META, lambda p: _write_json(p, meta))
                _fsync_dir(tmp)
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise _save_failed(e, step, root, rank, previous) from None
            _install(tmp, final)
            _write_latest(root, final.name)
            # Retention only after the new checkpoint is in place and lists completely (every file
            # at its recorded size); its digests were computed from the bytes written and its weights
            # checked finite, so the newest checkpoint kept is always a good one. Re-hashing it here
            # would only read back the page cache.
            read_checkpoint(final)
            rotate(root, keep_last=keep_last, newest=step)
        barrier()
        return final


def rotate(root: Path, *, keep_last: int, newest: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints at or before step ``newest``.

    Checkpoints *after* ``newest`` exist only when a run was resumed from an older checkpoint;
    they belong to the abandoned timeline and are replaced as the run reaches their step, so
    rotation leaves them alone. Returns the deleted folders.
    """
    if keep_last < 1:
        return []
    done = sorted((s, p) for s, p in step_dirs(root) if s <= newest)
    removed = []
    for _, path in done[:-keep_last]:
        # Rename first: a half-deleted folder must never look like a checkpoint.
        trash = path.with_name(f".trash-{path.name}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    return removed


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Makes the rename/creation of entries in `path` durable; without it a power loss can
    # forget a rename that already happened in the page cache.
    _fsync_file(path)


def _digest_file(rank: int) -> str:
    return f".digests-rank{rank:05d}.json"


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _naming(path: Path, write: Callable[[Path], T]) -> T:
    """``write(path)``; an ``OSError`` it raises names ``path`` if it names no file (``write()``
    and ``fsync()`` errors, ENOSPC among them, carry none)."""
    try:
        return write(path)
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


def _previous_id(root: Path, previous: Path | None | Literal["latest"]) -> str | None:
    """The ``id`` of the run's previous checkpoint (``meta.json``'s ``follows``); None: none, or
    one written before ids were (its successors are then found only through ``latest``)."""
    path = latest_target(root) if previous == "latest" else previous
    if path is None:
        return None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        ident = json.loads((path / META).read_text(encoding="utf-8")).get(ID_KEY)
        return ident if isinstance(ident, str) else None
    return None


def _save_failed(e: OSError | NonFiniteTensorError, step: int, root: Path, rank: int,
                 previous: Path | None | Literal["latest"]) -> RunFailed:
    """One line for a save that could not complete; the previous checkpoint is untouched."""
    keep = _last_good(root, previous)
    if isinstance(e, NonFiniteTensorError):
        return RunFailed(f"step {step}: the model weights hold NaN or inf ({e.name}); no checkpoint was "
                         f"written from this state; {keep}; lower train.lr or check the data")
    where = e.filename or root
    what = os.strerror(e.errno) if e.errno else str(e)
    return RunFailed(f"cannot write the checkpoint of step {step}: {what} (errno {e.errno}) at {where}; "
                     f"{'the partial folder was removed' if rank == 0 else 'rank 0 removes the partial folder'}; {keep}; "
                     "free space or choose another --output")


def _last_good(root: Path, previous: Path | None | Literal["latest"]) -> str:
    """Where the run can continue from: ``previous`` (save_checkpoint's docstring), read back."""
    prev: CheckpointInfo | None = None
    with contextlib.suppress(UserError):  # unreadable: said as "no earlier checkpoint"
        if previous == "latest":
            prev = resolve_checkpoint(root)
        elif previous is not None:
            prev = read_checkpoint(previous, advise=False)
    return (f"the last checkpoint {prev.path} is intact (resume with `zfctl resume {prev.path}`)" if prev
            else "no earlier checkpoint exists")


def _install(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; a same-named older folder (abandoned timeline) is replaced."""
    trash = None
    if final.exists():
        trash = final.with_name(f".trash-{final.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _write_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LATEST, name + "\n")  # fsynced file, then the rename ...
    _fsync_dir(root)  # ... made durable
