"""The ``carry`` host gradient layout (``zenflow.tuning.grad_layout: carry``): one fp32 sum per host
element, each landed chunk folded into it as it arrives, behind a small landing ring.

Where slots.py keeps one model-dtype slot per step of the interval (``U x itemsize`` B per host
element, per set) and sums them inside the CPU AdamW, this layout keeps 4 B per host element: the
*carry*, page-locked, laid out in the host column space as the master (a chunk at its ``ch.off``),
plus a landing *ring* of ``zenflow.tuning.ring_slots`` page-locked slots of the model dtype, each
one D2H ring slot in size (``ring_slot_mb``, sizing.py ``ring_slot_bytes``: a chunk fits one
slot, chunks.py). Host bytes: ``carry_host_bytes`` (sizing.py).

Every host-owned gradient chunk that the slots layout copies into the step's slot (stream.py
``GradStream._land``) instead lands in a ring slot and is then *folded* into the carry with native
``accumulate``: the interval's first step overwrites (``a = fma(g, u, +0)``, accumulate's
``overwrite``), later steps add (``a = fma(g, u, a)``), in step order per element. That is the
fma chain adamw_sum forms over the slots, step by step, so the carry holds the bits the slots'
chain has; at the boundary the CPU worker reads the carry as that chain's start with no slots
(a carry alone: ``take``, the device path's ``GradSlots(sum_buffer=True)`` does the same). ``u``
is the step's unscale, ``1 / loss_scale`` (1.0 without fp16 loss scaling), a host float known
when the step's landing is opened (``GradCarry.unscale``). A matrix without a gradient this step
(stream.py ``_fill``, ``-0.0`` on the slots layout, ``fma(-0, u, a) == a``) folds nothing, but on
an interval's first step it writes ``+0`` (what ``fma(-0, u, +0)`` gives), so every host element
of the carry belongs to this interval.

The slots layout records each step's coefficient (today: the clip factor times ``u``) and applies
it at the boundary; the carry applies ``u`` on arrival and the recorded coefficient is not used
(``record`` counts the step). So the two agree bit for bit where the coefficient is ``u``: without
clipping, and with clipping once the interval-mean rule (docs/design.md, "Algorithm") makes the
slots' coefficient ``u`` too.

Loss scaling (fp16): a step whose gradient overflows is skipped, which is known only once every
gradient has landed; a fold cannot be taken back out of the sum. So under loss scaling this layout
lands nothing from the hooks (``HostSide.lands_early`` False: the optimizer announces no final
backward to the gradient path) and step() lands the whole gradient after its overflow check: a
skipped step folds nothing. bf16 and fp32 stream from the hooks as on the slots layout, where
``u`` is 1, so a release step's selection moves the carry's columns as they are
(release.py ``regather_pairs``: entering columns read from the carry, exactly the step's fp32
gradient, leaving columns written into it, the fold the first step would have made).

Threads, buffers and waits (docs/design.md, "Threads and buffer ownership"):

| buffer | written by | read by | free / ordered by |
| --- | --- | --- | --- |
| a ring slot (page-locked, model dtype) | copy stream (a chunk's D2H, stream.py) | the fold thread, after the copy's event (``event.synchronize()``: ``fold.copy``) | the fold, then the slot is free; the issuing thread (a hook, step()) waits for a free slot (``host.ring_full``: it can stop the GPU, it is on the hook's thread) |
| the carry (page-locked, fp32) | the fold thread (folds, a missing gradient's ``+0`` on an interval's first step); a release selection's leaving columns (main thread, after ``drain``) | the CPU worker at the boundary, after ``fence`` (every fold issued so far done: ``worker.grads``); a checkpoint (``partial_sum_into``, after ``drain``: ``host.fold_drain``) | with ``overlap_step`` the next interval's writes of a piece are issued only once the update in flight has read it (acc_gate.py, one set: the issuing thread waits, ``host.slot_gate``), so the fold after them comes later still |

Without CUDA there is no copy stream and no fold thread: each chunk is copied into its ring slot
and folded at once, on the issuing thread (how CI tests the logic).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from zfctl.offload.device import pinned
from zfctl.offload.device.pcie import bind_device
from zfctl.offload.grads.slots import GradSlots
from zfctl.offload.ledger import NOWHERE, Ledger, Tab

# (copy event or None, ring slot or None, carry offset, elements, unscale, overwrite, the step's tab)
_Fold = tuple[Any, int | None, int, int, float, bool, Tab]


class GradCarry(GradSlots):
    """The carry layout's host side: the fp32 carry (``carry[0]``, persistent, as the device path's
    sum buffer), the landing ring and its fold owner (``Folds``). The slot interface the pipeline,
    the checkpoints and the gradient path use (slots.py) over it: ``per_set`` still bounds an
    interval (``full``: the same boundaries as the slots layout), ``next`` is the carry (the
    gradient lands there, through the ring), ``take`` hands the carry alone."""

    def __init__(self, numel: int, dtype: torch.dtype, *, per_set: int, pin: bool, device: torch.device,
                 ring_slots: int, slot_bytes: int, unscale: Callable[[], float]) -> None:
        super().__init__(numel, torch.float32, per_set=0, sets=1, pin=pin, device=device, sum_buffer=True)
        self.per_set, self.dtype = per_set, dtype  # interval bookkeeping; ``dtype``: the landed gradient's
        self.buffers = []  # no slots: ``carry[0]`` is the only gradient buffer (bind_host takes ``host_buffers``)
        self.unscale = unscale  # the step's u = 1 / loss_scale, read when a step's landing is opened
        self.started = False  # the carry holds this interval's partial sum (a step recorded, or a resumed sum)
        assert self.carry[0] is not None  # sum_buffer
        self.folds = Folds(self.carry[0], dtype, ring_slots=ring_slots, slot_bytes=slot_bytes, pin=pin,
                           device=device)

    @property
    def sets(self) -> int:
        return 1  # one carry: with overlap the next interval follows the worker (acc_gate.py)

    @property
    def host_buffers(self) -> list[torch.Tensor]:
        """The page-locked host buffers of this layout (cores.py binds them to the NUMA node)."""
        assert self.carry[0] is not None
        return [self.carry[0], self.folds.ring]

    def next(self, s: int) -> torch.Tensor:
        """Where this step's gradient ends up: the carry (stream.py lands it through the ring)."""
        assert self.used(s) < self.per_set, "an interval never has more steps than per_set (Pipeline.close_step)"
        carry = self.carry[0]
        assert carry is not None
        return carry

    def step_fold(self) -> tuple[float, bool]:
        """(u, overwrite) for the step whose landing opens now: overwrite on an interval's first step."""
        return float(self.unscale()), not self.started

    def record(self, s: int, coef: float) -> None:
        """The step that landed counts (its folds are issued; the coefficient is not applied: the
        carry took ``u`` on arrival, module docstring)."""
        super().record(s, coef)
        self.started = True

    def take(self, s: int) -> tuple[tuple[torch.Tensor, ...], tuple[float, ...], torch.Tensor | None]:
        """The interval for its CPU update: the carry alone (read after ``fence``); the next step
        starts a new interval (overwrites, behind acc_gate.py with overlap)."""
        self.coefs[s] = []
        self.started = False
        return (), (), self.carry[0]

    def partial_sum_into(self, s: int, out: torch.Tensor, lo: int, hi: int) -> None:
        """fp32 elements ``[lo, hi)`` of the interval's partial sum into ``out`` (a streamed save's
        chunk): copied out of the carry, after every fold issued so far."""
        self.folds.drain()
        carry = self.carry[0]
        assert carry is not None and self.started
        out.copy_(carry[lo:hi])

    def resume_buffer(self) -> torch.Tensor:
        """The carry itself, every fold issued so far done: a checkpoint's sum is loaded straight
        into it (no second 4 B per host element at a resume); ``resume`` then keeps it as it is."""
        self.folds.drain()
        carry = self.carry[0]
        assert carry is not None
        return carry

    def resume(self, s: int, carry: torch.Tensor | None) -> None:
        """Continue an interval from ``carry`` (fp32, copied into the carry), or start afresh (None)."""
        self.folds.drain()  # no fold of the discarded interval may land after this
        self.coefs = [[] for _ in range(self.sets)]
        self.started = carry is not None
        own = self.carry[0]
        if carry is not None and own is not None and carry.data_ptr() != own.data_ptr():
            own.copy_(carry)

    def release(self) -> None:
        """Stop the fold thread (after its folds), then unpin the carry and the ring."""
        self.folds.close()
        super().release()
        pinned.release(self.folds.ring)


class Folds:
    """The landing ring and the fold owner: on CUDA one thread per optimizer that waits for each
    chunk's copy event, folds the ring slot into the carry and frees the slot; off CUDA every fold
    runs at once on the caller. Folds run in issue order (one queue)."""

    ledger: Ledger = NOWHERE  # where its bytes and waits are counted (ledger.py; the optimizer's own)

    def __init__(self, carry: torch.Tensor, dtype: torch.dtype, *, ring_slots: int, slot_bytes: int, pin: bool,
                 device: torch.device) -> None:
        self.carry, self.dtype, self.device = carry, dtype, device
        self.slot_elems = slot_bytes // dtype.itemsize
        self.ring = pinned.empty(ring_slots * self.slot_elems, dtype, pin=pin, device=device)
        self.cuda = device.type == "cuda"
        self._cv = threading.Condition()
        self._free: deque[int] = deque(range(ring_slots))  # ring slots no fold still needs
        self._queue: deque[_Fold] = deque()
        self._issued = 0  # folds issued so far
        self._done = 0  # folds finished (in issue order)
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        if self.cuda:
            self.start()

    def start(self) -> None:
        """Start the fold thread (CUDA: at construction; tests/offload/test_grad_layout.py runs it
        over the CUDA stand-in, tests/offload/cuda_shim.py)."""
        self.cuda = True
        self._thread = threading.Thread(target=self._run, name="zfctl-fold", daemon=True)
        self._thread.start()

    # -- the issuing thread (a hook, step()) -------------------------------------------------------
    def slot(self, numel: int) -> tuple[int, torch.Tensor]:
        """A free ring slot for a chunk of ``numel`` elements (waits for one: ``host.ring_full``,
        counted when it blocks, as it depends on the fold thread's progress)."""
        assert numel <= self.slot_elems, "a chunk fits one ring slot (chunks.py cuts them at its size)"
        with self._cv:
            if not self._free:
                with self.ledger.waiting("host.ring_full"):
                    while not self._free and self._error is None:
                        self._cv.wait()  # a hook or step(): the fold of an earlier chunk frees one
            self._raise()
            i = self._free.popleft()
        return i, self.ring[i * self.slot_elems : i * self.slot_elems + numel]

    def fold(self, event: Any, i: int | None, off: int, numel: int, u: float, overwrite: bool) -> None:
        """Fold ring slot ``i`` (``numel`` elements, landed once ``event`` fired) into the carry at
        ``off``; ``i`` None: a missing gradient (``+0`` on an interval's first step, else nothing)."""
        job = (event, i, off, numel, u, overwrite, self.ledger.tab())
        if not self.cuda:
            self._fold(job)
            with self._cv:
                if i is not None:
                    self._free.append(i)
            return
        with self._cv:
            self._raise()
            self._queue.append(job)
            self._issued += 1
            self._cv.notify_all()

    def fence(self) -> Callable[[], None] | None:
        """The wait for every fold issued so far (the CPU worker's, before it reads the carry);
        None off CUDA, where every fold is done already."""
        if not self.cuda:
            return None
        target = self._issued
        return lambda: self._wait_done(target)

    def drain(self) -> None:
        """Host wait until every fold issued so far is done (checkpoints, loading, a release
        selection reading the carry, closing)."""
        if self.cuda and self._done < self._issued:
            with self.ledger.waiting("host.fold_drain"):
                self._wait_done(self._issued)
        self._raise()

    def close(self) -> None:
        """Finish the folds, then stop the thread (idempotent)."""
        if self._thread is None:
            return
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()
        self._thread = None

    def _wait_done(self, target: int) -> None:
        with self._cv:
            while self._done < target and self._error is None:
                self._cv.wait()  # the fold thread has not reached this fold yet
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError("a gradient fold into the carry failed (carry.py)") from self._error

    # -- the fold ------------------------------------------------------------------------------
    def _run(self) -> None:
        """The fold thread: one fold at a time, in issue order."""
        bind_device(self.device)  # its first CUDA call: no context on GPU 0 (pcie.py)
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue[0]
            try:
                self._fold(job)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting threads
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                return
            with self._cv:
                self._queue.popleft()
                if job[1] is not None:
                    self._free.append(job[1])
                self._done += 1
                self._cv.notify_all()

    def _fold(self, job: _Fold) -> None:
        from zfctl import _native

        event, i, off, numel, u, overwrite, tab = job
        with self.ledger.charging(tab):  # the step that issued it, however late it runs
            if event is not None:
                with self.ledger.waiting("fold.copy"):
                    event.synchronize()  # sync point (fold thread): this chunk's D2H into ring slot i
            dst = self.carry[off : off + numel]
            if i is None:  # a missing gradient: fma(-0, u, a) == a; the first step's +0
                if overwrite:
                    dst.fill_(0.0)
                    self.ledger.moved("host.fold", 4 * numel)
                return
            src = self.ring[i * self.slot_elems : i * self.slot_elems + numel]
            _native.accumulate(dst, src, scale=u, overwrite=overwrite)  # the fma of adamw_sum's chain
            self.ledger.moved("host.fold", numel * (src.element_size() + (4 if overwrite else 8)))
