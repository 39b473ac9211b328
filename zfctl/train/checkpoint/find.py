"""Finding checkpoints and deciding whether to trust them.

A checkpoint is *listed* when ``meta.json`` parses and every file has its recorded size (cheap:
used to find checkpoints and before rotation) and *intact* when every file's xxh3-128 digest
matches as well (one sequential read per file: done by resume and export on the files they load,
before loading anything). ``.tmp-*`` and ``.trash-*`` folders are never listed.

``latest`` names the checkpoint a run folder continues from, with one exception: a process killed
between a save's rename and its move of ``latest`` leaves a newer complete checkpoint that
``latest`` does not name. Its ``meta.json`` ``follows`` the id of the one ``latest`` names
(write.py), which no checkpoint of a timeline abandoned by a resume from an older checkpoint
does; :func:`resolve_checkpoint` uses it when every file verifies, and says so.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path

from zfctl.errors import UserError
from zfctl.train.checkpoint.format import (
    CHECKPOINTS,
    ID_KEY,
    LATEST,
    META,
    PLAN_FILE,
    PREVIOUS_KEY,
    CheckpointInfo,
)
from zfctl.train.checksum import HASH_NAME, file_digest


def resume_with(ckpt: Path) -> str:
    """How ``zfctl resume`` uses another checkpoint (the default advice)."""
    return f"zfctl resume {ckpt}"


# How the verb at work uses another checkpoint, for the lines that name the nearest intact one:
# resume's by default; `zfctl export` and `zfctl generate` set theirs (cli/export.py, cli/generate.py),
# since neither has --latest-good.
_USE_CHECKPOINT: ContextVar[Callable[[Path], str]] = ContextVar("use_checkpoint", default=resume_with)


def use_checkpoint_with(command: Callable[[Path], str]) -> None:
    """Set the command (for a checkpoint folder) that the damaged-checkpoint lines of this
    process advise, e.g. ``lambda c: f"zfctl export {c} --output out"``; each verb sets its own
    (a process may run several: the tests' in-process CLI)."""
    _USE_CHECKPOINT.set(command)


def older_checkpoint_fix(root: Path, before: int | None) -> str:
    """What to do instead of a damaged checkpoint under ``root`` (a ``checkpoints/`` folder):
    the nearest intact one older than step ``before`` and the command that uses it, or how to
    start again when there is none."""
    older = nearest_intact(root, before)
    in_run = root.name == CHECKPOINTS  # a run folder's checkpoints (not a checkpoint copied elsewhere)
    if older is not None:
        command = _USE_CHECKPOINT.get()
        also = f" (or `zfctl resume {root.parent} --latest-good`)" if command is resume_with and in_run else ""
        return (f"the nearest intact checkpoint is {older.path} (step {older.step}): use it with "
                f"`{command(older.path)}`{also}")
    if not in_run:
        return f"no older intact checkpoint exists next to it in {root}; use another checkpoint, or start a new run"
    return (f"no older intact checkpoint exists under {root}; start the run again with your `zfctl finetune` "
            f"command plus `--output {root.parent} --force`")


def _folder_step(path: Path) -> int | None:
    """The step a ``step-XXXXXX`` folder's name says (its meta.json may be unreadable)."""
    return int(path.name[5:]) if path.name.startswith("step-") and path.name[5:].isdigit() else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-XXXXXX`` folder under ``root``, unordered, unchecked."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit():
                out.append((int(p.name[5:]), p))
    return out


def read_checkpoint(path: Path, *, advise: bool = True) -> CheckpointInfo:
    """Validate a checkpoint folder; a UserError says what is wrong and what to do (``advise``:
    the nearest intact older checkpoint, found by reading the older ones' digests; off where
    the caller only lists checkpoints and skips the unreadable ones)."""
    path = Path(path)

    def hint() -> str:
        return older_checkpoint_fix(path.parent, _folder_step(path)) if advise else "unreadable"

    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
        files = meta["files"]
        step, world = int(meta["step"]), int(meta["world_size"])
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} is unreadable: {META} is missing (incomplete write?); {hint()}") from None
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise UserError(f"checkpoint {path} is unreadable: {META} is corrupt ({e}); {hint()}") from None
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise UserError(f"checkpoint {path} is unreadable: {name} is missing; {hint()}")
        if f.stat().st_size != size:
            raise UserError(
                f"checkpoint {path} is unreadable: {name} has {f.stat().st_size} bytes, "
                f"expected {size} (truncated or overwritten); {hint()}"
            )
    return CheckpointInfo(path=path, step=step, world_size=world,
                          version=str(meta.get("zfctl_version", "?")), meta=meta)


def newest_listed(root: Path, before: int | None = None) -> CheckpointInfo | None:
    """The newest checkpoint under ``root`` (before step ``before``) whose listing is complete."""
    for step, p in sorted(step_dirs(root), reverse=True):
        if before is not None and step >= before:
            continue
        try:
            return read_checkpoint(p, advise=False)
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
    for step, p in sorted(step_dirs(root), reverse=True):
        if before is not None and step >= before:
            continue
        try:
            info = read_checkpoint(p, advise=False)
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
    fix = older_checkpoint_fix(info.path.parent, info.step)
    raise UserError(f"checkpoint {info.path} is damaged: {', '.join(bad)} does not match the digest in "
                    f"{META} (same size, different bytes: corrupted on disk); {fix}")


def resolve_checkpoint(path: Path, notes: list[str] | None = None, *,
                       latest_good: bool = False) -> CheckpointInfo:
    """A checkpoint folder, a run folder (its newest checkpoint) or a ``checkpoints/`` folder.

    ``latest_good``: for a run or ``checkpoints/`` folder, the newest checkpoint whose every file
    verifies against its digests (newer damaged ones are skipped on purpose; each costs one read).
    ``notes`` receives one line when ``latest`` is missing or broken and an older checkpoint is
    used instead, or when a checkpoint saved after the one ``latest`` names is found (used when
    every file of it verifies: :func:`saved_after`), so the caller can say so (resume, export).
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint path {path} does not exist; give a run folder or one of its "
                        "checkpoints/step-XXXXXX folders")
    if (path / META).exists():
        return read_checkpoint(path)
    root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    target, why = _pointer(root)
    if latest_good:
        # Never past what ``latest`` names (or the checkpoint saved after it): a run resumed from
        # an earlier step keeps the later checkpoints of the timeline it left (rotation keeps
        # them), which are not its past.
        limit = None
        if target is not None:
            with contextlib.suppress(UserError):  # an unreadable target bounds nothing
                named = read_checkpoint(target, advise=False)
                limit = (saved_after(root, named) or named).step + 1
        good = nearest_intact(root, before=limit)
        if good is not None:
            return good
        raise UserError(f"no intact checkpoint under {path} (every one is incomplete or damaged); start the run "
                        f"again with your `zfctl finetune` command plus `--output {_run_of(root)} --force`")
    if target is not None:
        return _or_saved_after(root, read_checkpoint(target), notes)
    # No usable pointer (killed between the rename and the pointer update, or edited by hand):
    # fall back to the newest folder that validates.
    newest = newest_listed(root)
    if newest is None:
        run = _run_of(root)
        if (run / PLAN_FILE).is_file():  # a run folder whose run stopped before its first checkpoint
            raise UserError(f"no readable checkpoint under {path}: its run stopped before writing one, so there is "
                            f"nothing to continue; start it again with your `zfctl finetune` command plus "
                            f"`--output {run} --force` (--force replaces the folder's contents)")
        raise UserError(f"no readable checkpoint under {path}; give a run folder with checkpoints/ or a "
                        "checkpoints/step-XXXXXX folder")
    if notes is not None:
        notes.append(f"{why}; falling back to the newest readable checkpoint, {newest.path.name}")
    return newest


def _pointer(root: Path) -> tuple[Path | None, str]:
    """The folder ``root/latest`` names, if it has a meta.json; else None and why not."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None, f"{pointer} is missing"
    try:
        target = root / pointer.read_bytes().decode("utf-8").strip()
    except (UnicodeDecodeError, ValueError):  # bytes that are no name (damaged on disk, an editor's)
        return None, f"{pointer} is not a checkpoint name (its bytes are not text: damaged?)"
    if not (target / META).exists():
        return None, f"{pointer} names {target.name}, which does not exist or has no {META}"
    return target, ""


def latest_target(root: Path) -> Path | None:
    """The checkpoint folder that ``root``'s (a ``checkpoints/`` folder) ``latest`` names, if any."""
    return _pointer(root)[0]


def saved_after(root: Path, info: CheckpointInfo) -> CheckpointInfo | None:
    """The listed checkpoint under ``root`` that its run saved right after ``info`` (its meta.json
    ``follows`` ``info``'s id), if any: what a process killed between that save's rename and its
    move of ``latest`` leaves (module docstring). A ``meta.json`` read per newer folder: none,
    when ``latest`` names the newest."""
    ident = info.meta.get(ID_KEY)
    if not ident:  # written before ids were
        return None
    for step, p in sorted(step_dirs(root), reverse=True):
        if step <= info.step:
            break
        with contextlib.suppress(UserError):
            newer = read_checkpoint(p, advise=False)
            if newer.meta.get(PREVIOUS_KEY) == ident:
                return newer
    return None


def _or_saved_after(root: Path, named: CheckpointInfo, notes: list[str] | None) -> CheckpointInfo:
    """``named`` (what ``latest`` names), or the checkpoint saved after it (:func:`saved_after`)
    if every one of its files verifies (one read of each); ``notes`` gets a line saying which."""
    newer = saved_after(root, named)
    if newer is None:
        return named
    bad = damaged_files(newer)
    if notes is not None:
        pointer, old, new = root / LATEST, named.path.name, newer.path.name
        notes.append(f"{pointer} names {old}; {new}, saved after it, is damaged ({', '.join(bad)} does not match its "
                     f"digest), so {old} is used" if bad else
                     f"{pointer} names {old}, but {new} was saved after it and every file verifies (the process "
                     f"ended before it moved {LATEST}); using {new}")
    return named if bad else newer


def _run_of(root: Path) -> Path:
    """The run folder of a ``checkpoints/`` folder (or of what was given instead)."""
    return root.parent if root.name == CHECKPOINTS else root
