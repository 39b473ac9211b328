"""Crash-safe checkpoints: ``OUTPUT/checkpoints/step-XXXXXX/``, a ``latest`` pointer, rotation.

A checkpoint folder holds everything a run needs to continue on the same trajectory:

| file | content |
| --- | --- |
| ``model.safetensors`` | model weights as the optimizer left them (tied tensors stored once) |
| ``optimizer-rankRRRRR.pt`` | the optimizer's full state_dict (ZenFlow: selection, device and host masters and moments, counters, unfinished-interval accumulators, auto-interval statistics, loss scaler) |
| ``rng-rankRRRRR.pt`` | torch CPU/CUDA, Python and NumPy RNG states of that rank |
| ``trainer.pt`` | step, LR-scheduler state, data position, the run's counters |
| ``plan.yaml`` | the resolved run plan |
| ``meta.json`` | zfctl version, step, world size, and every file's size: written last |

Atomicity: everything is written into ``checkpoints/.tmp-step-XXXXXX/``, each file fsynced, then
the folder is renamed into place and the parent fsynced; only then does ``latest`` (a one-line
text file, replaced atomically) move. A process killed at any point leaves either the old state
or the new one: a ``.tmp-*`` folder is never read and is cleared by the next save. A checkpoint is
valid iff ``meta.json`` parses and every file it lists has the recorded size.

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
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from zfctl import __version__
from zfctl.errors import UserError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
PLAN_FILE = "plan.yaml"
# Test hook: "STEP:SECONDS" sleeps inside the write of that step's checkpoint (after the model
# file, before meta.json), so a test can SIGKILL the process mid-write deterministically.
SLOW_WRITE_ENV = "ZFCTL_TEST_SLOW_CHECKPOINT"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def optimizer_file(rank: int) -> str:
    return f"optimizer-rank{rank:05d}.pt"


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


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


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
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
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
                    barrier: Callable[[], None] = lambda: None) -> Path:
    """Write ``run_dir/checkpoints/step-XXXXXX`` atomically; every rank calls this.

    Rank 0 writes the model, the trainer state, the plan and meta.json, renames the folder into
    place, moves ``latest`` and rotates old checkpoints; every rank writes its own optimizer and
    RNG files. ``barrier`` must synchronise all ranks (a no-op for one process).
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / step_name(step)
    tmp = root / f".tmp-{step_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a process killed mid-write
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier()  # tmp exists before any rank writes into it

    _torch_save(optimizer_state, tmp / optimizer_file(rank))
    _torch_save(capture_rng(), tmp / rng_file(rank))
    if rank == 0:
        save_model(model, str(tmp / MODEL_FILE), metadata={"format": "pt", "step": str(step)})
        _fsync_file(tmp / MODEL_FILE)
        _slow_write_hook(step)
        _torch_save(trainer_state, tmp / TRAINER_FILE)
        write_plan(tmp / PLAN_FILE)
        _fsync_file(tmp / PLAN_FILE)
    barrier()  # every rank's files are durable

    if rank == 0:
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        meta = {"zfctl_version": __version__, "step": step, "world_size": world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
        meta_path = tmp / META
        with open(meta_path, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        _install(tmp, final)
        _write_latest(root, final.name)
        rotate(root, keep_last=keep_last, newest=step)
    barrier()
    return final


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


def resolve_checkpoint(path: Path, notes: list[str] | None = None) -> CheckpointInfo:
    """A checkpoint folder, a run folder (its newest checkpoint) or a ``checkpoints/`` folder.

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
    pointer = root / LATEST
    why = f"{pointer} is missing"
    if pointer.is_file():
        target = root / pointer.read_text(encoding="utf-8").strip()
        if (target / META).exists():
            return read_checkpoint(target)
        why = f"{pointer} names {target.name}, which does not exist or has no {META}"
    # No usable pointer (killed between the rename and the pointer update, or edited by hand):
    # fall back to the newest folder that validates.
    for _, p in sorted(_step_dirs(root), reverse=True):
        try:
            info = read_checkpoint(p)
        except UserError:
            continue
        if notes is not None:
            notes.append(f"{why}; falling back to the newest readable checkpoint, {p.name}")
        return info
    raise UserError(f"no readable checkpoint under {path}; give a run folder with checkpoints/ or a "
                    "checkpoints/step-XXXXXX folder")


def load_model_weights(info: CheckpointInfo, model: torch.nn.Module) -> None:
    """Copy the checkpoint's weights into ``model`` (same architecture; strict)."""
    try:
        missing, unexpected = load_model(model, str(info.path / MODEL_FILE), strict=False)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise UserError(f"checkpoint {info.path} is unreadable: {MODEL_FILE}: {e}") from None
    if missing or unexpected:
        raise UserError(f"checkpoint {info.path} does not match the model: missing "
                        f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")


def load_torch(info: CheckpointInfo, name: str) -> Any:
    """Load one of the checkpoint's torch files onto the CPU."""
    try:
        # weights_only: a checkpoint is tensors, numbers and strings; refusing arbitrary pickled
        # objects means loading a checkpoint someone sent you cannot run their code.
        return torch.load(info.path / name, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint {info.path} has no {name}") from None
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise UserError(f"checkpoint {info.path} is unreadable: {name}: {e}") from None
