"""Graceful stop on Ctrl-C / SIGTERM: finish the step, checkpoint, exit 130 / 143.

The handler only records the request; the loop polls it once per optimizer step (a Python
attribute read, no syscall), so a step is never torn in half and the checkpoint is a normal,
exactly resumable one. A request that comes while a checkpoint is being written (or the model
evaluated) is seen once that is done: a save in progress is finished and is the stop checkpoint,
and no further step is trained (zfctl/train/recipe.py). A second signal aborts at once without
a checkpoint, for a user who cannot wait for the step to end; it says so in one line (which
checkpoint the run folder still has), removes the partial folder of a save in progress
(zfctl/train/checkpoint/write.py, ``abandon_save``) and exits 130 / 143 through the normal
unwinding, so the CPU worker thread and the run folder's lock are still released.

A rank of a multi-process job whose loop ends with an error (a peer died: the collective
raised) does not go back to the default handlers at once: torchrun SIGTERMs the survivors of a
dead rank within a fraction of a second, and on a loaded machine that signal can land while the
rank is still tearing down, before its one error line is out; the default action would end it
without a word, as if it had said what happened. :func:`hold_signals` absorbs one such signal
instead, until the process exits (docs/design.md, "Failures and the run folder").
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


# The handlers :func:`hold_signals` replaced, once it has been called in this process.
_before_hold: dict[int, Callable[[int, FrameType | None], Any] | int | None] | None = None


def hold_signals() -> None:
    """Absorb the next SIGINT/SIGTERM this process receives; a further one acts as the handlers
    before the call would. For a rank of a multi-process job that is about to report an error:
    torchrun's SIGTERM must not end it before its line is out (module docstring), and torchrun
    SIGKILLs it after 30 s in any case. Once per process (a rank exits after its error line);
    main thread only."""
    global _before_hold
    if _before_hold is not None or threading.current_thread() is not threading.main_thread():
        return
    _before_hold = {s: signal.getsignal(s) for s in _HANDLED}
    for s in _HANDLED:
        signal.signal(s, _held)


def _held(signum: int, frame: FrameType | None) -> None:
    for s, prev in (_before_hold or {}).items():  # the next one is not absorbed
        signal.signal(s, prev)


class StopSignals:
    """Context manager turning SIGINT/SIGTERM into a polled stop request.

    Outside the main thread (signal handlers cannot be installed there) it never fires, and the
    process keeps Python's default handling. ``hold_on_error``: leaving with an exception other
    than the stop's own, call :func:`hold_signals` (a rank of a multi-process job).
    """

    def __init__(self, on_first: Callable[[int], None] | None = None,
                 abort_message: Callable[[int], str | None] | None = None, *, hold_on_error: bool = False) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}  # signal.signal()
        self._on_first = on_first
        self._abort_message = abort_message
        self._hold_on_error = hold_on_error

    def voted(self, device: Any, world_size: int) -> bool:
        """Whether any rank holds a stop request; every rank calls it at the same point (with
        several processes one tiny all-reduce, so all stop at the same step or none does)."""
        from zfctl.train.loss import all_reduce_sum

        (votes,) = all_reduce_sum([float(self.requested)], device, world_size)
        return votes > 0

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
        global _received
        _received = None  # a new run: an earlier run's stop in this process is not this one's
        if threading.current_thread() is threading.main_thread():
            for s in _HANDLED:
                self._previous[s] = signal.signal(s, self._handle)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # The caller's handlers again: after the stop checkpoint (on disk, every rank past its
        # final barrier) a further signal may end the process the default way.
        previous, self._previous = self._previous, {}
        for s, prev in previous.items():
            signal.signal(s, prev)
        # A failed rank's error line is still to come: one more signal (torchrun's, after a peer
        # died) must not end it silently first.
        if (previous and self._hold_on_error and exc_type is not None
                and not issubclass(exc_type, (Interrupted, Aborted))):
            hold_signals()


def run_stop_signals(say: Callable[[str], None], *, rank: int, run_dir: Path,
                     newest: Callable[[], int | None], world_size: int = 1,
                     abandon: Callable[[], tuple[int | None, Path | None]] = lambda: (None, None)) -> StopSignals:
    """The loop's :class:`StopSignals`: ``say`` announces the first signal on the console; the
    second one's line (rank 0 only) names the newest checkpoint, step ``newest()`` (None: none).
    ``abandon``: called by that second signal's handler on rank 0 first, it ends the save in
    progress (write.py ``abandon_save``): (its step, if it was already installed; its partial
    folder, if that is left on disk). With several processes a loop that fails holds the next
    signal (:func:`hold_signals`)."""

    def abort_message(signum: int) -> str | None:
        if rank != 0:
            return None
        installed, left = abandon()
        if installed is not None:
            return f"the checkpoint of step {installed} was already written (continue: zfctl resume {run_dir})"
        step = newest()
        return "no checkpoint was written; " + (
            f"the newest in {run_dir} is step {step} (continue: zfctl resume {run_dir})" if step
            else f"{run_dir} has none yet") + (
            f"; its partial folder {left} is left for the next start to remove" if left is not None else "")

    return StopSignals(
        hold_on_error=world_size > 1,
        on_first=lambda s: say("[yellow]stop requested: finishing this step and writing a checkpoint "
                               "(press Ctrl-C again to abort without one)"),
        abort_message=abort_message)


def interrupted(signum: int, step: int, run_dir: str) -> Interrupted:
    """The exception to raise once the stop checkpoint is on disk."""
    name = signal.Signals(signum).name
    return Interrupted(signum, f"stopped by {name} after step {step}; checkpoint saved. "
                               f"Continue with: zfctl resume {run_dir}")

