"""One host accumulator with ``overlap_step``: the next interval's first writes wait for the CPU
update to have read what they overwrite.

With two accumulators (``zenflow.tuning.host_accumulators: 2``) the next interval sums into the
other one and nothing waits. With one (4 B per host element less: the host path's 16 B/param),
the CPU update of interval k reads ``acc`` while interval k+1's first step overwrites it. So the
worker updates the accumulator piece by piece, in a fixed order (the order the gradient path
writes chunks in: ``GradientPath.write_order``), and publishes how many pieces it has finished
(the *watermark*); the first write of interval k+1 into a chunk waits until the watermark has
passed that chunk. Only first writes wait: they write every host chunk (the gradient, or zeros
for a matrix without one), and every later write of the interval comes after them in the same
thread's order. Results never depend on timing: each element is read by the update before it is
overwritten, exactly the values the second accumulator would have held; only the waits differ.

Which update a write must wait for is fixed when the write is *issued* (main thread, in step
order), not when it runs: ``waiter()`` takes a ticket (the number of updates submitted so far).
A hook-path job of interval k may still be queued when update k is submitted (an interval of one
step, or the late accumulation after clipping); it holds ticket k-1, so it does not wait for the
update that waits for it. A write of interval k+1 is issued after update k's submit and holds
ticket k.

Where the waits fall: the step() path waits on the main thread inside ``step()`` (stall); the
hook path waits on the accumulation thread (stream.py ``_add``), which the device waits for only
when a later hook needs its landing buffer back (two steps later) or at the next boundary; on CPU
without a late coefficient the hook adds synchronously, so the backward waits. ``waits`` and
``wait_ms`` count them (``StepStats.acc_gate_waits``/``acc_gate_ms``). The cost: when the CPU
update takes longer than about one step, the next step waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

Waiter = Callable[[int], None]


class AccGate:
    """The watermark of the update in flight over the shared accumulator, and the wait on it."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._issued = 0  # updates submitted so far: the ticket a write issued now holds
        self._reading = 0  # the number of the update that is reading acc piece by piece; 0: none
        self._position: dict[int, int] = {}  # chunk offset -> its piece's position in the update's order
        self._passed = 0  # pieces the update in flight has finished
        self.waits = 0  # writes that had to wait (since the last ``take_counts``)
        self.wait_ms = 0.0

    def waiter(self) -> Waiter:
        """The wait a first write issued now must do before overwriting the chunk at an offset
        (main thread, in step order: the ticket is the update submitted last)."""
        return partial(self.wait, self._issued)

    def start(self, offsets: Sequence[int]) -> None:
        """A new update reads the accumulator in this order of chunk offsets (main thread, at
        submit, before the worker can run: no write issued after this passes unchecked)."""
        with self._cv:
            self._issued += 1
            self._reading = self._issued
            self._position = {off: i for i, off in enumerate(offsets)}
            self._passed = 0

    def passed(self, pieces: int) -> None:
        """The update in flight has finished its first ``pieces`` pieces (CPU worker)."""
        with self._cv:
            self._passed = pieces
            self._cv.notify_all()

    def end(self) -> None:
        """The update in flight is done with the accumulator, or failed (CPU worker, always)."""
        with self._cv:
            self._reading = 0
            self._cv.notify_all()

    def wait(self, ticket: int, off: int) -> None:
        """Block until update ``ticket`` (if it is the one in flight) has read the chunk at ``off``.
        An offset not in its order waits for the whole update: after a re-selection, which no
        longer collects the update before it re-plans, a chunk that was all device-owned when the
        update was submitted (the update reads nothing there; rare: ``topk_ratio`` of the columns
        would have to fill a whole chunk), so the wait is conservative."""
        with self._cv:
            if ticket == 0 or self._reading != ticket:
                return
            need = self._position.get(off, len(self._position) - 1) + 1
            if self._passed >= need:
                return
            t0 = time.perf_counter()
            while self._reading == ticket and self._passed < need:
                self._cv.wait()  # accumulation or main thread: the CPU update has not read it yet
            self.waits += 1
            self.wait_ms += (time.perf_counter() - t0) * 1e3

    def take_counts(self) -> tuple[int, float]:
        """(waits, ms) since the last call (the optimizer reports them per step)."""
        with self._cv:
            out = (self.waits, self.wait_ms)
            self.waits, self.wait_ms = 0, 0.0
            return out
