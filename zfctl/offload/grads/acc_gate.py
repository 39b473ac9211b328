"""One gradient slot set with ``overlap_step``: the next interval's writes wait for the CPU update
to have read what they overwrite.

With two slot sets (``zenflow.tuning.host_accumulators: 2``, slots.py) the next interval lands in
the other set and nothing waits. The carry layout (carry.py) is one set: its one fp32 sum is read
by the update as the next interval's first step overwrites it, so its writes (a chunk's copy into
the landing ring, whose fold comes after; a missing gradient's ``+0``) wait here the same way. With one (``update_interval x itemsize`` B per host element
less), the CPU update of interval k reads the set's slots while interval k+1's steps overwrite
them. So the worker updates piece by piece, in a fixed order (the order the gradient path writes
chunks in: ``GradientPath.write_order``), reading every slot of a piece at once, and publishes
how many pieces it has finished (the *watermark*); each write of interval k+1 into a chunk of a
slot (a copy, or a ``-0.0`` fill) waits until the watermark has passed that chunk. Results never
depend on timing: each element is read by the update before it is overwritten, exactly the
values the second set would have held; only the waits differ.

Which update a write must wait for is fixed when the write is *issued* (in step order), not when
it runs: ``waiter()`` takes a ticket (the number of updates submitted so far). Every write of
interval k is issued before update k is submitted (the hooks and step() land a step's gradient
before its boundary), so it holds ticket k-1 and never waits for the update that reads it; a
write of interval k+1 is issued after update k's submit and holds ticket k.

Where the waits fall: on the thread that issues the write, before its copy is enqueued: a hook
(the backward waits) or step() (stall). ``waits`` and ``wait_ms`` count them
(``StepStats.acc_gate_waits``/``acc_gate_ms``, and the ledger's ``host.slot_gate``: only the waits
that blocked, since whether one does depends on the worker's progress). The cost: when the CPU update takes longer than
about one step, the next steps wait for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from zfctl.offload.ledger import NOWHERE, Ledger

Waiter = Callable[[int], None]


class AccGate:
    """The watermark of the update in flight over the shared slot set, and the wait on it."""

    ledger: Ledger = NOWHERE  # where its blocking waits are counted (ledger.py; the optimizer's own)

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._issued = 0  # updates submitted so far: the ticket a write issued now holds
        self._reading = 0  # the number of the update that is reading acc piece by piece; 0: none
        self._position: dict[int, int] = {}  # chunk offset -> its piece's position in the update's order
        self._passed = 0  # pieces the update in flight has finished
        self.waits = 0  # writes that had to wait (since the last ``take_counts``)
        self.wait_ms = 0.0

    def waiter(self) -> Waiter:
        """The wait a write issued now must do before overwriting the chunk at an offset (issued in
        step order: the ticket is the update submitted last)."""
        return partial(self.wait, self._issued)

    def start(self, offsets: Sequence[int]) -> None:
        """A new update reads the slot set in this order of chunk offsets (main thread, at
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
        """The update in flight is done with the slot set, or failed (CPU worker, always)."""
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
                self._cv.wait()  # a hook or step(): the CPU update has not read it yet
            ms = (time.perf_counter() - t0) * 1e3
            self.waits += 1
            self.wait_ms += ms
        self.ledger.waited("host.slot_gate", ms=ms)

    def take_counts(self) -> tuple[int, float]:
        """(waits, ms) since the last call (the optimizer reports them per step)."""
        with self._cv:
            out = (self.waits, self.wait_ms)
            self.waits, self.wait_ms = 0, 0.0
            return out
