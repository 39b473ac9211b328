"""One writer per run folder: an advisory ``fcntl.flock`` on ``RUN/.zfctl.lock``.

``finetune``, ``resume`` and ``export`` (reading a run) hold it while they work; a second one
gets a single line naming the holder (pid, host, start time) instead of three processes writing
the same checkpoints, or ``--force`` emptying a folder a live run writes into.

The kernel drops a flock when its holder exits, however it exits, so a SIGKILLed run never
blocks the next one: the lock file it left still names it, and the next writer takes the lock
over with a note. A clean exit removes the file. Removing a lock file races with a process that
opened it just before (it would lock an unlinked inode), so after locking we check that the path
still names the inode we locked and retry otherwise.

Costs one open + flock + small write per command; the lock is advisory (only zfctl honours it)
and, on network filesystems, only as good as their flock emulation.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from zfctl.errors import UserError

LOCK_FILE = ".zfctl.lock"


class RunInUse(UserError):
    """Another live process holds the run folder's lock."""


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} "
            f"since {holder.get('started', '?')}")


def _in_use(run_dir: Path, what: str, holder: dict) -> RunInUse:
    return RunInUse(f"{what} {run_dir} is in use by {_describe(holder)}; wait for that run to finish "
                    f"or stop it (kill -TERM {holder.get('pid', 'PID')}), or choose another folder")


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (UnicodeDecodeError, ValueError):
        holder = {}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """The held lock of one run folder; :meth:`release` (or leaving :func:`held`) gives it back."""

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the lock file, then unlock (unlinking first: a waiter that wins next sees a
        fresh file, never ours)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


class FolderLock:
    """A run's hold on its folder's lock, taken once: early when the folder exists, else when the
    run creates it (``take`` again is a no-op); ``release`` at the end. Only rank 0 takes it."""

    def __init__(self, note: Callable[[str], None] | None = None) -> None:
        self.note = note  # receives the line about a stale lock taken over
        self.held: RunLock | None = None

    def take(self, run_dir: Path) -> None:
        if self.held is None:
            self.held = acquire(run_dir, note=self.note)

    def release(self) -> None:
        if self.held is not None:
            self.held.release()
            self.held = None


def acquire(run_dir: Path, *, what: str = "run folder",
            note: Callable[[str], None] | None = None) -> RunLock:
    """Lock ``run_dir`` (which must exist) for this process, or raise :class:`RunInUse`.

    ``note`` receives one line when a stale lock (its holder is gone) is taken over.
    """
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    for _ in range(10):  # retries only when another process removed the file under us
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise _in_use(run_dir, what, holder) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the holder released and removed the file between our open and flock
            os.close(fd)
            continue
        stale = _read_holder(fd)
        if stale and note is not None:
            note(f"{run_dir}: took over the lock of {_describe(stale)}, which is no longer running "
                 "(it was killed or crashed)")
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode("utf-8"), 0)
        return RunLock(run_dir, fd)
    raise RunInUse(f"{what} {run_dir}: could not take its lock ({path} keeps changing); try again")


def check_free(run_dir: Path, *, what: str = "run folder") -> None:
    """Raise :class:`RunInUse` if a live process holds ``run_dir``'s lock (holds nothing after).

    For the ``--nproc`` launcher and early checks: the real lock is taken later, by the process
    that writes. Nothing is created in a folder without a lock file.
    """
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        holder = _read_holder(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise _in_use(run_dir, what, holder) from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def held(run_dir: Path, *, what: str = "run folder", note: Callable[[str], None] | None = None,
         optional: bool = False) -> Iterator[RunLock | None]:
    """``acquire`` as a context manager. ``optional``: a folder nobody can write to (read-only
    mount, no permission) needs no lock, and is read without one."""
    try:
        lock = acquire(run_dir, what=what, note=note)
    except OSError as e:
        if optional and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            yield None
            return
        raise
    try:
        yield lock
    finally:
        lock.release()
