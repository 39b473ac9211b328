"""Graceful stop on Ctrl-C / SIGTERM: finish the step, checkpoint, exit 130 / 143.

The handler only records the request; the loop polls it once per optimizer step (a Python
attribute read, no syscall), so a step is never torn in half and the checkpoint is a normal,
exactly resumable one. A second signal restores the default behaviour: Ctrl-C again aborts at
once without a checkpoint, for a user who cannot wait for the step to end.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

_HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(SystemExit):
    """Raised after the stop checkpoint; exits with 128 + signal number (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message


class StopSignals:
    """Context manager turning SIGINT/SIGTERM into a polled stop request.

    Outside the main thread (signal handlers cannot be installed there) it never fires, and the
    process keeps Python's default handling.
    """

    def __init__(self, on_first: Callable[[int], None] | None = None) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._on_first = on_first

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            for s, prev in self._previous.items():  # the next signal acts immediately
                signal.signal(s, prev)
            if self._on_first is not None:
                self._on_first(signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s in _HANDLED:
                self._previous[s] = signal.signal(s, self._handle)

    def __exit__(self, *exc: object) -> None:
        if self.signum is None:
            for s, prev in self._previous.items():
                signal.signal(s, prev)
        self._previous = {}


def interrupted(signum: int, step: int, run_dir: str) -> Interrupted:
    """The exception to raise once the stop checkpoint is on disk."""
    name = signal.Signals(signum).name
    return Interrupted(signum, f"stopped by {name} after step {step}; checkpoint saved. "
                               f"Continue with: zfctl resume {run_dir}")

