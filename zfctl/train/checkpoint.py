"""Crash-safe checkpoints: ``OUTPUT/checkpoints/step-XXXXXX/``, a ``latest`` pointer, rotation.

A checkpoint folder holds everything a run needs to continue on the same trajectory:

| file | content |
| --- | --- |
| ``model.safetensors`` | model weights as the optimizer left them (tied tensors stored once) |
| ``optimizer-rankRRRRR.safetensors`` | the optimizer's full state_dict (ZenFlow: selection, device and host masters and moments, counters, unfinished-interval accumulators, auto-interval statistics, loss scaler), streamed from the live buffers (tensorfile.py); checkpoints written before that hold ``optimizer-rankRRRRR.pt`` (torch.save), which still loads |
| ``rng-rankRRRRR.pt`` | torch CPU/CUDA, Python and NumPy RNG states of that rank |
| ``trainer.pt`` | step, LR-scheduler state, data position, the run's counters |
| ``plan.yaml`` | the resolved run plan |
| ``meta.json`` | zfctl version, step, world size, every file's size and xxh3-128 digest: written last |

Atomicity: everything is written into ``checkpoints/.tmp-step-XXXXXX/``, each file fsynced, then
the folder is renamed into place and the parent fsynced; only then does ``latest`` (a one-line
text file, replaced atomically) move. A process killed at any point leaves either the old state
or the new one: a ``.tmp-*`` folder is never read and is cleared by the next start or save.

Trust: every file is hashed while it is written (``zfctl.train.checksum``); resume and export
re-hash the files they read (:func:`verify_checkpoint`) before loading anything. A checkpoint is
*listed* when ``meta.json`` parses and every file has its recorded size (cheap, used to find
checkpoints) and *intact* when every digest matches as well. Model weights holding NaN/inf are
never written, and rotation runs only once the new checkpoint is installed and its listing
re-read, so keep-last-K cannot delete the last good checkpoint in favour of a bad one.

Disk space: before each save the free space is compared with the previous checkpoint's size (or
:func:`estimate_bytes` before the first); any ``OSError`` while writing becomes one line with the
errno's meaning and the ``.tmp-*`` folder is removed.

With ``overlap_step`` the model weights alone are one CPU update behind what the run would
export (that update is in flight inside the optimizer state); ``zfctl export`` installs it.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import _remove_duplicate_names

from zfctl import __version__
from zfctl.errors import RunFailed, UserError
from zfctl.train.checksum import (
    HASH_NAME,
    NonFiniteTensorError,
    file_digest,
    save_model_hashed,
    save_torch_hashed,
)
from zfctl.train.tensorfile import load_state, save_state_hashed, tensors_of

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
PLAN_FILE = "plan.yaml"
# Test hook: "STEP:SECONDS" sleeps inside the write of that step's checkpoint (after the model
# file, before meta.json), so a test can SIGKILL the process mid-write deterministically.
SLOW_WRITE_ENV = "ZFCTL_TEST_SLOW_CHECKPOINT"
# Optimizer-state bytes per trainable parameter in a checkpoint, for the free-space check before
# the first save: fp32 master + two moments + the host gradient accumulator (16 B) plus the
# device-side copies of the selected columns (~1 B at topk 0.1). Measured 17.0 on tiny-llama.
OPTIMIZER_BYTES_PER_PARAM = 17


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def optimizer_file(rank: int) -> str:
    """The optimizer state file a save writes for ``rank`` (tensorfile.py format)."""
    return f"optimizer-rank{rank:05d}.safetensors"


def legacy_optimizer_file(rank: int) -> str:
    """The torch.save file of checkpoints written before the state was streamed."""
    return f"optimizer-rank{rank:05d}.pt"


def optimizer_file_in(info: CheckpointInfo, rank: int) -> str:
    """The name of ``rank``'s optimizer file in the checkpoint ``info`` (either format)."""
    legacy = legacy_optimizer_file(rank)
    return legacy if legacy in info.meta.get("files", {}) else optimizer_file(rank)


def load_optimizer(info: CheckpointInfo, name: str) -> Any:
    """An optimizer state file of ``info``: its large tensors as file ranges the optimizer reads
    straight into its buffers (tensorfile.py); a legacy ``.pt`` memory-mapped by torch.load."""
    if name.endswith(".pt"):
        return load_torch(info, name, mmap=True)
    path = info.path / name
    if not path.is_file():
        raise UserError(f"checkpoint {info.path} has no {name}")
    try:
        return load_state(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"checkpoint {info.path} is unreadable: {name}: {e}; pick another checkpoint") from None


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


@dataclass
class CheckpointInfo:
    """A validated checkpoint folder and its ``meta.json``."""

    path: Path
    step: int
    world_size: int
    version: str
    meta: dict[str, Any]


# ----------------------------------------------------------------------------------- writing


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


def _slow_write_hook(step: int) -> None:
    spec = os.environ.get(SLOW_WRITE_ENV)
    if spec:
        at, _, seconds = spec.partition(":")
        if int(at) == step:
            time.sleep(float(seconds or 30))


def capture_rng() -> dict[str, Any]:
    """Every RNG a training step may draw from (dropout, data augmentation, user code)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        # Stored as plain tensors and numbers, not numpy objects, so that the file loads with
        # torch.load(weights_only=True) like every other checkpoint file.
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    except ImportError:  # numpy is optional for zfctl itself
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))


def save_checkpoint(run_dir: Path, step: int, *, model: torch.nn.Module, optimizer_state: dict,
                    trainer_state: dict, write_plan: Callable[[Path], None], keep_last: int,
                    rank: int = 0, world_size: int = 1,
                    barrier: Callable[[], None] = lambda: None, estimate: int = 0) -> Path:
    """Write ``run_dir/checkpoints/step-XXXXXX`` atomically; every rank calls this.

    Rank 0 writes the model, the trainer state, the plan and meta.json, renames the folder into
    place, moves ``latest`` and rotates old checkpoints; every rank writes its own optimizer and
    RNG files. ``barrier`` must synchronise all ranks (a no-op for one process). ``estimate``:
    the expected size in bytes when no earlier checkpoint says it (see :func:`estimate_bytes`).

    Raises :class:`RunFailed` (nothing installed, ``.tmp-*`` removed) when the disk lacks the
    space, a write fails, or the model weights hold NaN/inf.
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / step_name(step)
    tmp = root / f".tmp-{step_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        clean_stale(root)
    barrier()  # stale folders are gone before any rank measures the free space
    # Every rank checks the same numbers, so all refuse together instead of some waiting in a
    # barrier for a rank that stopped.
    try:
        check_free_space(root, last_size(root) or estimate, when=f"before the checkpoint of step {step}")
    except UserError as e:
        raise RunFailed(f"{e}; {_last_good(root)}") from None
    if rank == 0:
        tmp.mkdir()
    barrier()  # tmp exists before any rank writes into it

    digests: dict[str, str] = {}
    try:
        # Streamed from the live state: no copy of it in memory (tensorfile.py).
        digests[optimizer_file(rank)] = save_state_hashed(optimizer_state, tmp / optimizer_file(rank))
        digests[rng_file(rank)] = save_torch_hashed(capture_rng(), tmp / rng_file(rank))
        if rank == 0:
            digests[MODEL_FILE] = save_model_hashed(model, tmp / MODEL_FILE,
                                                    {"format": "pt", "step": str(step)})
            _slow_write_hook(step)
            digests[TRAINER_FILE] = save_torch_hashed(trainer_state, tmp / TRAINER_FILE)
            write_plan(tmp / PLAN_FILE)
            digests[PLAN_FILE] = file_digest(tmp / PLAN_FILE)  # a few KB: hashed by reading it back
        else:  # rank 0 collects every rank's digests for meta.json
            _write_json(tmp / _digest_file(rank), digests)
    except (OSError, NonFiniteTensorError) as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_failed(e, step, root) from None
    barrier()  # every rank's files are durable

    if rank == 0:
        try:
            for r in range(1, world_size):
                part = tmp / _digest_file(r)
                digests.update(json.loads(part.read_text(encoding="utf-8")))
                part.unlink()
            files = {name: (tmp / name).stat().st_size for name in sorted(digests)}
            _write_json(tmp / META, {
                "zfctl_version": __version__, "step": step, "world_size": world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files,
                "hash": HASH_NAME, "digests": {n: digests[n] for n in sorted(digests)}})
            _fsync_dir(tmp)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _save_failed(e, step, root) from None
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


def _digest_file(rank: int) -> str:
    return f".digests-rank{rank:05d}.json"


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _save_failed(e: OSError | NonFiniteTensorError, step: int, root: Path) -> RunFailed:
    """One line for a save that could not complete; the previous checkpoint is untouched."""
    keep = _last_good(root)
    if isinstance(e, NonFiniteTensorError):
        return RunFailed(f"step {step}: the model weights hold NaN or inf ({e.name}); no checkpoint was "
                         f"written from this state; {keep}; lower train.lr or check the data")
    where = e.filename or root
    what = os.strerror(e.errno) if e.errno else str(e)
    return RunFailed(f"cannot write the checkpoint of step {step}: {what} (errno {e.errno}) at {where}; "
                     f"the partial folder was removed; {keep}; free space or choose another --output")


def _last_good(root: Path) -> str:
    prev = _newest_listed(root)
    return (f"the last checkpoint {prev.path} is intact (resume with `zfctl resume {prev.path}`)" if prev
            else "no earlier checkpoint exists")


def clean_stale(root: Path) -> list[Path]:
    """Remove ``.tmp-*`` / ``.trash-*`` folders a killed process left under ``root``."""
    removed = []
    if root.is_dir():
        for stale in list(root.glob(".tmp-*")) + list(root.glob(".trash-*")):
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


def estimate_bytes(model: torch.nn.Module) -> int:
    """Expected checkpoint size before the first save: the weights + the optimizer state."""
    seen, weights = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:  # tied tensors are stored once
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return weights + OPTIMIZER_BYTES_PER_PARAM * trainable


def last_size(root: Path) -> int:
    """Bytes of the newest listed checkpoint under ``root`` (0 if none): the next save's size."""
    info = _newest_listed(root)
    return sum(int(v) for v in info.meta["files"].values()) if info else 0


def check_run_space(out: Path, estimate: int, *, reclaim: bool = False, clean: bool = True) -> None:
    """Before a run: clean a killed process's ``.tmp-*`` folders, refuse if one checkpoint cannot fit.

    The size is the newest checkpoint's (a resumed run) or ``estimate``. ``reclaim`` (``--force``
    over an old run folder): the checkpoints about to be deleted count as free. ``clean`` only
    under the run folder's lock: without it a ``.tmp-*`` may be a live run's save in progress.
    """
    root = Path(out) / CHECKPOINTS
    if clean:
        clean_stale(root)
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
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def rotate(root: Path, *, keep_last: int, newest: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints at or before step ``newest``.

    Checkpoints *after* ``newest`` exist only when a run was resumed from an older checkpoint;
    they belong to the abandoned timeline and are replaced as the run reaches their step, so
    rotation leaves them alone. Returns the deleted folders.
    """
    if keep_last < 1:
        return []
    done = sorted((s, p) for s, p in _step_dirs(root) if s <= newest)
    removed = []
    for _, path in done[:-keep_last]:
        # Rename first: a half-deleted folder must never look like a checkpoint.
        trash = path.with_name(f".trash-{path.name}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    return removed


# ----------------------------------------------------------------------------------- reading


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit():
                out.append((int(p.name[5:]), p))
    return out


def read_checkpoint(path: Path) -> CheckpointInfo:
    """Validate a checkpoint folder; a UserError says what is wrong and what to do."""
    path = Path(path)
    hint = "pick another checkpoint (see the checkpoints/ folder) or start a new run"
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
        files = meta["files"]
        step, world = int(meta["step"]), int(meta["world_size"])
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} is unreadable: {META} is missing (incomplete write?); {hint}") from None
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise UserError(f"checkpoint {path} is unreadable: {META} is corrupt ({e}); {hint}") from None
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise UserError(f"checkpoint {path} is unreadable: {name} is missing; {hint}")
        if f.stat().st_size != size:
            raise UserError(
                f"checkpoint {path} is unreadable: {name} has {f.stat().st_size} bytes, "
                f"expected {size} (truncated or overwritten); {hint}"
            )
    return CheckpointInfo(path=path, step=step, world_size=world,
                          version=str(meta.get("zfctl_version", "?")), meta=meta)


def _newest_listed(root: Path, before: int | None = None) -> CheckpointInfo | None:
    """The newest checkpoint under ``root`` (before step ``before``) whose listing is complete."""
    for step, p in sorted(_step_dirs(root), reverse=True):
        if before is not None and step >= before:
            continue
        try:
            return read_checkpoint(p)
        except UserError:
            continue
    return None


def damaged_files(info: CheckpointInfo, names: list[str] | None = None) -> list[str]:
    """Files of ``info`` (all, or ``names``) whose content does not match meta.json's digest.

    One sequential read of each file. A checkpoint written before digests existed has none to
    check (its sizes were checked by :func:`read_checkpoint`).
    """
    digests = info.meta.get("digests") or {}
    if info.meta.get("hash", HASH_NAME) != HASH_NAME:
        raise UserError(f"checkpoint {info.path}: meta.json uses hash {info.meta['hash']!r}, this zfctl "
                        f"knows {HASH_NAME}; use the zfctl version that wrote it ({info.version})")
    bad = []
    for name in names if names is not None else sorted(digests):
        want = digests.get(name)
        if want is not None and (info.path / name).is_file() and file_digest(info.path / name) != want:
            bad.append(name)
    return bad


def nearest_intact(root: Path, before: int | None = None) -> CheckpointInfo | None:
    """The newest checkpoint under ``root`` (older than step ``before``, if given) whose every file
    verifies."""
    for step, p in sorted(_step_dirs(root), reverse=True):
        if before is not None and step >= before:
            continue
        try:
            info = read_checkpoint(p)
        except UserError:
            continue
        if not damaged_files(info):
            return info
    return None


def verify_checkpoint(info: CheckpointInfo, names: list[str] | None = None) -> None:
    """Raise one line naming the damaged file and the nearest intact older checkpoint, if any."""
    bad = damaged_files(info, names)
    if not bad:
        return
    root = info.path.parent
    older = nearest_intact(root, info.step)
    if older is not None:
        fix = (f"the nearest intact checkpoint is {older.path} (step {older.step}): resume from it with "
               f"`zfctl resume {older.path}` (or `zfctl resume {root.parent} --latest-good`)")
    else:
        fix = "no older intact checkpoint exists under the run folder; start a new run"
    raise UserError(f"checkpoint {info.path} is damaged: {', '.join(bad)} does not match the digest in "
                    f"{META} (same size, different bytes: corrupted on disk); {fix}")


def resolve_checkpoint(path: Path, notes: list[str] | None = None, *,
                       latest_good: bool = False) -> CheckpointInfo:
    """A checkpoint folder, a run folder (its newest checkpoint) or a ``checkpoints/`` folder.

    ``latest_good``: for a run or ``checkpoints/`` folder, the newest checkpoint whose every file
    verifies against its digests (newer damaged ones are skipped on purpose; each costs one read).
    ``notes`` receives one line when ``latest`` is missing or broken and an older checkpoint is
    used instead, so the caller can say so (resume, export).
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint path {path} does not exist; give a run folder or one of its "
                        "checkpoints/step-XXXXXX folders")
    if (path / META).exists():
        return read_checkpoint(path)
    root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    if latest_good:
        good = nearest_intact(root)
        if good is not None:
            return good
        raise UserError(f"no intact checkpoint under {path} (every one is incomplete or damaged); "
                        "start a new run")
    pointer = root / LATEST
    why = f"{pointer} is missing"
    if pointer.is_file():
        target = root / pointer.read_text(encoding="utf-8").strip()
        if (target / META).exists():
            return read_checkpoint(target)
        why = f"{pointer} names {target.name}, which does not exist or has no {META}"
    # No usable pointer (killed between the rename and the pointer update, or edited by hand):
    # fall back to the newest folder that validates.
    newest = _newest_listed(root)
    if newest is None:
        raise UserError(f"no readable checkpoint under {path}; give a run folder with checkpoints/ or a "
                        "checkpoints/step-XXXXXX folder")
    if notes is not None:
        notes.append(f"{why}; falling back to the newest readable checkpoint, {newest.path.name}")
    return newest


def load_model_weights(info: CheckpointInfo, model: torch.nn.Module) -> None:
    """Copy the checkpoint's weights into ``model`` (same architecture; strict), one tensor at a
    time straight into the parameters: no second copy of the model in memory."""
    path = info.path / MODEL_FILE
    try:
        stored = tensors_of(path)
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint {info.path} is unreadable: {MODEL_FILE}: {e}") from None
    state = model.state_dict()
    # Tied weights are stored once, under one of their names: any name of a tie group will do.
    groups = {name: [name, *others] for name, others in _remove_duplicate_names(dict(state)).items()}
    alias = {n: group for group in groups.values() for n in group}
    missing = [n for n in state if not any(a in stored for a in alias.get(n, [n]))]
    unexpected = [n for n in stored if n not in state]
    if missing or unexpected:
        raise UserError(f"checkpoint {info.path} does not match the model: missing "
                        f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    try:
        with torch.no_grad():
            for name, t in stored.items():
                if tuple(state[name].shape) != t.shape:
                    raise ValueError(f"{name} has shape {list(t.shape)}, the model {list(state[name].shape)}")
                t.copy_to(state[name])
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"checkpoint {info.path} is unreadable: {MODEL_FILE}: {e}") from None


def load_torch(info: CheckpointInfo, name: str, *, mmap: bool = False) -> Any:
    """Load one of the checkpoint's torch files onto the CPU (``mmap``: tensors map the file
    instead of being read into new memory)."""
    try:
        # weights_only: a checkpoint is tensors, numbers and strings; refusing arbitrary pickled
        # objects means loading a checkpoint someone sent you cannot run their code.
        return torch.load(info.path / name, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise UserError(f"checkpoint {info.path} has no {name}") from None
    except pickle.UnpicklingError:
        # torch's own text here advises weights_only=False, i.e. running whatever code the file
        # holds: the wrong advice for a file that is damaged or not a zfctl checkpoint.
        raise UserError(f"checkpoint {info.path} is unreadable: {name} holds objects other than tensors "
                        "and numbers (damaged, or not written by zfctl); pick another checkpoint") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {info.path} is unreadable: {name}: {first}; pick another checkpoint") from None
