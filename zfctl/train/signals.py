"""Graceful stop on Ctrl-C / SIGTERM: finish the step, checkpoint, exit 130 / 143.

The handler only records the request; the loop polls it once per optimizer step (a Python
attribute read, no syscall), so a step is never torn in half and the checkpoint is a normal,
exactly resumable one. A second signal aborts at once without a checkpoint, for a user who
cannot wait for the step to end; it says so in one line (which checkpoint the run folder still
has) and exits 130 / 143 through the normal unwinding, so the CPU worker thread and the run
folder's lock are still released.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

_HANDLED = (signal.SIGINT, signal.SIGTERM)
# The first stop signal this process received in a run, for a rank whose stop checkpoint then
# cannot be written (a peer died: torchrun SIGTERMs the survivors): its error line says so
# (zfctl/train/dist.py, rank_error) instead of leaving "writing a checkpoint" uncorrected.
_received: int | None = None


def stop_received() -> int | None:
    """The signal number of the stop request this process received, if any."""
    return _received


class Interrupted(SystemExit):
    """Raised after the stop checkpoint; exits with 128 + signal number (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message


class Aborted(SystemExit):
    """Raised by the second signal: exits with 128 + signal number, without a checkpoint."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class StopSignals:
    """Context manager turning SIGINT/SIGTERM into a polled stop request.

    Outside the main thread (signal handlers cannot be installed there) it never fires, and the
    process keeps Python's default handling.
    """

    def __init__(self, on_first: Callable[[int], None] | None = None,
                 abort_message: Callable[[int], str | None] | None = None) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}  # signal.signal()
        self._on_first = on_first
        self._abort_message = abort_message

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        global _received
        if self.signum is None:
            self.signum = _received = signum
            for s in self._previous:  # the next signal acts immediately
                signal.signal(s, self._abort)
            if self._on_first is not None:
                self._on_first(signum)

    def _abort(self, signum: int, frame: FrameType | None) -> None:
        for s, prev in self._previous.items():  # a third signal: Python's default, no more words
            signal.signal(s, prev)
        name = signal.Signals(signum).name
        text = self._abort_message(signum) if self._abort_message else "no checkpoint was written"
        if text:  # None: a rank other than 0, which stays quiet
            # os.write, not print: this runs between any two bytecodes, possibly inside a print.
            os.write(2, f"aborted by a second {name}: {text}\n".encode())
        raise Aborted(signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s in _HANDLED:
                self._previous[s] = signal.signal(s, self._handle)

    def __exit__(self, *exc: object) -> None:
        # Always the caller's handlers again: after the stop checkpoint (on disk, every rank past
        # its final barrier) a further signal may end the process the default way.
        for s, prev in self._previous.items():
            signal.signal(s, prev)
        self._previous = {}


def run_stop_signals(say: Callable[[str], None], *, rank: int, run_dir: Path,
                     newest: Callable[[], int | None]) -> StopSignals:
    """The loop's :class:`StopSignals`: ``say`` announces the first signal on the console; the
    second one's line (rank 0 only) names the newest checkpoint, step ``newest()`` (None: none)."""
    return StopSignals(
        on_first=lambda s: say("[yellow]stop requested: finishing this step and writing a checkpoint "
                               "(press Ctrl-C again to abort without one)"),
        abort_message=lambda s: None if rank != 0 else "no checkpoint was written; " + (
            f"the newest in {run_dir} is step {newest()} (continue: zfctl resume {run_dir})"
            if newest() else f"{run_dir} has none yet"))


def interrupted(signum: int, step: int, run_dir: str) -> Interrupted:
    """The exception to raise once the stop checkpoint is on disk."""
    name = signal.Signals(signum).name
    return Interrupted(signum, f"stopped by {name} after step {step}; checkpoint saved. "
                               f"Continue with: zfctl resume {run_dir}")

