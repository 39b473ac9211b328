"""The CPU worker thread: runs the native AdamW over the host-owned columns at each boundary.

One thread, one update at a time. ``submit`` hands it the interval's gradient (its per-step slots
with their unscales, a carry: slots.py, and the interval's ``grad_scale``), the hyper-parameters of this boundary and the
waits it must do first (the last copy into the interval's slots, the install DMA still reading
the master); from then until ``wait`` returns, the worker owns the host master, moments and that
interval's slots (see the table in ``host``). One native call per step-counter group and piece
forms the interval's sum and runs AdamW on it in one pass (``adamw_sum``: ``CpuWorker._adamw``).
The native kernels release the GIL and split each call over their own thread pool, so the main
thread keeps launching device work meanwhile. Results never depend on timing: the worker touches
only buffers the main thread leaves alone until ``wait``, and the main thread decides, by step
count alone, when to wait and install.

An update runs in *pieces* (element ranges, in order), for three reasons, none of which changes
a bit (AdamW is per element: runs.py):

* with one slot set and ``overlap_step`` (acc_gate.py) the next interval writes the slots the
  update reads: the update carries ``pieces`` (the chunks in the order the gradient path writes
  them) and publishes after each one how far it has read (``AccGate.passed``); each write of the
  next interval waits for that;
* on the device path the interval sum lands matrix by matrix (device_acc.py ``copy_out``): the
  update carries ``fences``, each piece with the wait for its own copy event, in copy order, so
  the update starts on the first matrix while the rest is still on the link;
* a selection (selector.py) takes the entering columns' state while the update submitted one
  step earlier still runs: ``request`` asks the worker to update those elements first (at the
  next piece boundary, if not done yet), then to run the job the selection hands it (``hand``:
  the migration's fill, which gathers those rows into the in ring, migration.py), and the worker
  leaves them out of the pieces that follow. The selection waits for that part only
  (``wait_request``), not the whole update; ``prioritize`` is the same without a job (the
  data-parallel selection).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from zfctl.offload.cpu.correction import DeferredLrScale, corrected_hyperparams, inner_steps
from zfctl.offload.cpu.host import HostState
from zfctl.offload.cpu.runs import cut_runs, plan_pieces, runs_and_minus
from zfctl.offload.device.pcie import bind_device
from zfctl.offload.ledger import NOWHERE, Ledger, count_adamw_sum

# (offset, elements, the wait for that piece's data or None): one piece of an update, in order.
Piece = tuple[int, int, Callable[[], Any] | None]


@dataclass(frozen=True)
class CpuUpdate:
    """Everything one CPU AdamW update needs, passed by value at submission. The interval's
    sum is ``S = sum_j coefs[j] * slots[j]`` on top of ``carry``, formed with the rounding of a
    per-step fp32 accumulation (slots.py, native ``adamw_sum``), and AdamW takes ``S * grad_scale``."""

    slots: tuple[torch.Tensor, ...]  # the interval's per-step gradient slots (model dtype), in step order
    coefs: tuple[float, ...]  # each slot's coefficient: its step's unscale u (1 / fp16 loss scale, or 1)
    carry: torch.Tensor | None  # fp32 partial sum the chain starts from (a resumed interval, the device path's sum)
    # (sum of the interval's clip factors / n) / n: the interval-mean gradient times the mean clip
    # factor (docs/design.md, "Algorithm", step 5); 1 / n without clipping.
    grad_scale: float
    groups: list[tuple[int, torch.Tensor]]  # (1-based step, runs) per step-counter group
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    repeat: int = 1  # AdamW steps per element, all with this gradient (correction.inner_steps)
    # One shared slot set (acc_gate.py): (offset, elements) of each chunk, in the order the next
    # interval writes them; the update runs and publishes piece by piece. None: one pass.
    pieces: tuple[tuple[int, int], ...] | None = None
    # The device path (device_acc.py): (offset, elements, wait) of each matrix of the interval
    # sum, in copy order; the update waits for each piece's copy event just before its runs.
    fences: tuple[Piece, ...] | None = None


@dataclass(frozen=True)
class PieceWaits:
    """What a gradient path hands the update when its sum lands piece by piece (device_acc.py
    ``copy_out``): each piece's wait, in landing order. Called as one fence, it waits for all."""

    pieces: tuple[Piece, ...]

    def __call__(self) -> None:
        for _, _, wait in self.pieces:
            if wait is not None:
                wait()


@dataclass
class _Request:
    """A selection's ask (``CpuWorker.request``): update these elements first, then run ``then``
    (the migration's fill, migration.py), which the requester hands over later (``hand``)."""

    runs: torch.Tensor
    done: bool = False
    handed: bool = True  # ``then`` is set (None: nothing to run); ``request`` posts one that waits for ``hand``
    then: Callable[[], Any] | None = None
    error: BaseException | None = None  # what ``then`` raised, for the requester


def cpu_update(mode: DeferredLrScale, n: int, grad: tuple[tuple[torch.Tensor, ...], tuple[float, ...],
               torch.Tensor | None], groups: Callable[[int], list], hp: dict[str, float],
               pieces: tuple[tuple[int, int], ...] | None = None, clip_mean: float = 1.0) -> CpuUpdate:
    """The update of an interval of ``n`` steps: its gradient (``grad``: slots, unscales, carry,
    from ``Pipeline.take``) as the interval mean times the mean of its steps' clip factors
    (``clip_mean``, Python float: ``grad_scale = clip_mean / n``, rounded to fp32 once), the boundary's
    hyper-parameters with ``zenflow.deferred_lr_scale``'s correction for the ``n`` steps the
    deferred columns stood still (correction.py: a scaled lr, or ``repeat``: n steps), and the
    step-counter groups (``groups(steps)``: HostState.update_groups, which advances them);
    ``pieces``: the shared slot set's read order (acc_gate.py), or None."""
    lr, wd = corrected_hyperparams(mode, n, hp["lr"], hp["weight_decay"])
    reps = inner_steps(mode, n)
    slots, coefs, carry = grad
    return CpuUpdate(slots, coefs, carry, clip_mean / n, groups(reps), lr, hp["beta1"], hp["beta2"], hp["eps"], wd,
                     reps, pieces)


def clip_runs(runs: torch.Tensor, ends: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The part of a sorted, non-overlapping run list that lies in elements [lo, hi) (``ends``:
    each run's end, ``runs[:, 0] + runs[:, 1]``, contiguous)."""
    if hi <= lo:
        return runs[:0]
    i0 = int(torch.searchsorted(ends, lo, right=True))  # the first run ending after lo
    i1 = int(torch.searchsorted(ends, hi, right=False))  # runs before i1 end at or before hi
    if i1 < runs.shape[0] and int(runs[i1, 0]) < hi:
        i1 += 1  # the run that straddles hi
    out = runs[i0:i1].clone()
    if out.shape[0]:
        start = max(int(out[0, 0]), lo)
        out[0, 1] = int(out[0, 0]) + int(out[0, 1]) - start
        out[0, 0] = start
        out[-1, 1] = min(int(out[-1, 0]) + int(out[-1, 1]), hi) - int(out[-1, 0])
    return out


class CpuWorker:
    """A single background thread owning the host state while an update is in flight."""

    ledger: Ledger = NOWHERE  # where its bytes and fences are counted (ledger.py; the optimizer's own)

    def __init__(self, host: HostState, device: torch.device) -> None:
        from zfctl import _native  # raises UserError("run make setup") when the library is missing

        self.native = _native
        self._host = host
        # The thread's first call binds it to the optimizer's device: its waits are CUDA event
        # syncs, which would otherwise create a context on GPU 0 (pcie.bind_device).
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="zenflow-cpu",
                                                                   initializer=bind_device, initargs=(device,))
        self._future: Future | None = None
        self.threads = 0  # cap on the update's native threads (threads.py); 0 = all
        # Tests only: called with a piece's index before the worker reads it (a slow worker makes
        # a missing wait on the shared slot set, or on a priority request, show as wrong bits).
        self.before_piece: Callable[[int], None] | None = None
        # The default cut of an update without ``pieces`` or ``fences``: each matrix's range.
        self._ranges = [(s.host_off, s.host_numel) for s in host.layout.host_slots]
        self._cv = threading.Condition()  # guards the two fields below (main thread and worker)
        self._active = False  # an update is submitted and has not finished its last piece
        self._request: _Request | None = None
        self._deferred: list[Future] = []
        self._job: Future | None = None  # a job ``hand`` queued without a request (``wait_request`` waits)
        self.priority_waits, self.priority_ms = 0, 0.0  # prioritize calls that waited, and how long
        self.priority_cuts = 0  # run cuts to pieces done for priority requests: one per request served

    @property
    def busy(self) -> bool:
        """True while an update is submitted and not yet waited for."""
        return self._future is not None

    def run(self, update: CpuUpdate) -> float:
        """Apply one update on the calling thread, piece by piece; returns its duration in ms."""
        t0 = time.perf_counter()
        pieces = self._pieces(update)
        # What is left to update, per counter group: a served request's elements leave it (_serve).
        left = [(step, runs, (runs[:, 0] + runs[:, 1]).contiguous()) for step, runs in update.groups]
        waited: set[int] = set()
        try:
            for i, (off, n, _) in enumerate(pieces):
                if self.before_piece is not None:
                    self.before_piece(i)
                self._serve(update, pieces, i, left, waited)
                self._wait_piece(pieces, i, waited)
                for step, runs, end in left:
                    part = clip_runs(runs, end, off, off + n)
                    if part.shape[0]:
                        self._adamw(update, step, part)
                if update.pieces is not None:
                    self._host.gate.passed(i + 1)  # the next interval may overwrite pieces 0..i now
        finally:
            with self._cv:  # a request posted during the last piece: everything is updated now
                self._active = False
                self._cv.notify_all()
        # Nothing to clear: the set's next interval writes every host chunk of each slot it uses.
        return (time.perf_counter() - t0) * 1e3

    def _pieces(self, update: CpuUpdate) -> list[Piece]:
        """The update's pieces: the shared accumulator's chunks, the sum's matrices in copy order
        (cut to ``PIECE_ELEMS``, the wait on the first cut), or each matrix's range."""
        if update.pieces is not None:
            assert update.fences is None, "one accumulator shared with the next interval has no copy fences"
            return [(off, n, None) for off, n in update.pieces]
        if update.fences is not None:
            out: list[Piece] = []
            for off, n, wait in update.fences:
                out += [(o, m, wait if o == off else None) for o, m in plan_pieces([(off, n)])]
            return out
        return [(off, n, None) for off, n in plan_pieces(self._ranges)]

    @staticmethod
    def _wait_piece(pieces: list[Piece], j: int, waited: set[int]) -> None:
        wait = pieces[j][2]
        if wait is not None and j not in waited:
            wait()  # worker thread: that piece of the sum has landed (device path: its copy event)
            waited.add(j)

    def _serve(self, update: CpuUpdate, pieces: list[Piece], i: int,
               left: list[tuple[int, torch.Tensor, torch.Tensor]], waited: set[int]) -> None:
        """A pending priority request: update its elements in pieces ``i..`` now (pieces before
        ``i`` are done), take them out of ``left`` (each group's (step, runs, ends) still to
        update: ``run`` owns it, this replaces its entries), and wake the requester. Each group's
        entering and remaining lists are built once over the whole request (one vectorised sweep:
        runs.py ``runs_and_minus``), and the entering lists cut to all pieces ``i..`` in one ``cut_runs``: no set
        algebra per piece (~10^5 runs to ~10^2 pieces at 1B parameters)."""
        with self._cv:
            req = self._request
        if req is None:
            return
        entering = []
        for g, (step, runs, _) in enumerate(left):
            part, rest = runs_and_minus(runs, req.runs)
            entering.append(part)
            left[g] = (step, rest, (rest[:, 0] + rest[:, 1]).contiguous())
        cut = cut_runs(entering, [(off, n) for off, n, _ in pieces[i:]])
        self.priority_cuts += 1
        for j, parts in enumerate(cut, start=i):
            for (step, _, _), part in zip(left, parts):
                if part.shape[0]:
                    self._wait_piece(pieces, j, waited)
                    self._adamw(update, step, part)
        with self._cv:
            while not req.handed:
                self._cv.wait()  # the requester is enqueueing the leaving moves: ms at most
            then = req.then
        try:
            if then is not None:
                then()  # the entering rows, just updated, into the in ring (migration.py fill)
        except Exception as e:  # noqa: BLE001 -- re-raised by the requester (wait_request); the update goes on
            req.error = e
        with self._cv:
            req.done, self._request = True, None
            self._cv.notify_all()

    def _adamw(self, update: CpuUpdate, step: int, runs: torch.Tensor) -> None:
        """The one native call of an update (per step-counter group, per piece): the interval's
        sum formed from its slots and AdamW on it, one pass. Host bytes per element: 24 (master
        and moments read and written) + each slot's itemsize (+ 4 with a carry)."""
        h = self._host
        count_adamw_sum(self.ledger, h.master, update.slots, carry=update.carry, runs=runs,
                        out=h.upload)  # host.sum + host.update, the submitting step's tab
        self.native.adamw_sum(
            h.master, h.exp_avg, h.exp_avg_sq, update.slots, update.coefs, carry=update.carry, step=step,
            lr=update.lr, beta1=update.beta1, beta2=update.beta2, eps=update.eps,
            weight_decay=update.weight_decay, grad_scale=update.grad_scale, runs=runs, repeat=update.repeat,
            out=h.upload,  # bf16/fp16: the install source (host.py upload)
        )

    def submit(self, update: CpuUpdate, waits: Sequence[Callable[[], Any]] = ()) -> None:
        """Start ``update`` in the background; the worker first calls each of ``waits`` (the last
        copy into the interval's slots: stream.py; the device path's sum copy out: device_acc.py;
        the install DMA still reading the master: chunks.py). At most one update is ever in flight. An update
        with ``pieces`` closes the slot gate here, on the submitting thread, so that no
        write issued after this call can pass before the worker has read its piece."""
        if self._pool is None:
            raise RuntimeError("ZenFlowOptimizer is closed")
        if self._future is not None:
            raise RuntimeError("a CPU update is already in flight; wait() for it first")
        gate = self._host.gate if update.pieces is not None else None
        if gate is not None:
            gate.start([off for off, _ in update.pieces or ()])
        with self._cv:
            self._active, self._request = True, None

        def run() -> float:
            try:
                self.native.set_thread_role(0, self.threads)  # this worker thread's share of the cores
                for wait in waits:
                    wait()  # worker thread: the slots have landed, the master is free, only after these
                return self.run(update)
            finally:
                with self._cv:  # failed before its pieces: no requester may wait forever
                    self._active = False
                    self._cv.notify_all()
                if gate is not None:
                    gate.end()  # done reading (or failed: no writer may wait forever)

        self._future = self._pool.submit(self.ledger.charged(run))  # counted into the submitting step

    def prioritize(self, runs: torch.Tensor) -> float:
        """Main thread: have the update in flight update the elements of ``runs`` (a run list)
        before anything else it has left, and return once they are (ms waited; 0 when no update
        is in flight or it has finished). The worker then leaves them out of its other pieces, so
        every element is still updated exactly once: the same bits as without the request."""
        req = self.request(runs)
        self.hand(req, None)
        return self.wait_request(req, None)

    def request(self, runs: torch.Tensor) -> _Request | None:
        """Main thread: post a priority request for ``runs`` without waiting (None when no update
        is in flight or nothing is asked). Every request must be handed its job (``hand``): the
        worker waits for it after updating ``runs``."""
        with self._cv:
            if not self._active or runs.shape[0] == 0:
                return None
            req = self._request = _Request(runs, handed=False)
            return req

    def hand(self, req: _Request | None, then: Callable[[], Any] | None) -> None:
        """Main thread: the job to run right after ``req``'s elements are updated (None: nothing).
        Without a request it goes to the worker thread now, behind whatever it has queued."""
        if req is not None:
            with self._cv:
                req.then, req.handed = then, True
                self._cv.notify_all()
        elif then is not None:
            assert self._pool is not None, "ZenFlowOptimizer is closed"
            self._job = self._pool.submit(then)

    def wait_request(self, req: _Request | None, then: Callable[[], Any] | None) -> float:
        """Main thread: wait until ``req`` is served and ``then`` has run (re-raises its error); ms
        waited. An update that finished before it reached the request updated those elements in
        its own pieces; ``then`` then runs on the worker thread now."""
        job, self._job = self._job, None
        if req is None and job is None:
            return 0.0
        t0 = time.perf_counter()
        if req is not None:
            with self._cv:
                while not req.done and self._active:
                    self._cv.wait()  # sync point (selection steps): the worker's entering part
            if req.error is not None:
                raise req.error
            if not req.done and then is not None:
                assert self._pool is not None, "ZenFlowOptimizer is closed"
                self._pool.submit(then).result()  # sync point: the fill, after the finished update
        if job is not None:
            job.result()  # sync point: the fill, on the worker thread
        ms = (time.perf_counter() - t0) * 1e3
        if req is not None:
            self.priority_waits += 1
            self.priority_ms += ms
        return ms

    @property
    def requested(self) -> bool:
        """A priority request waits to be served (tests: to post one at a known piece)."""
        with self._cv:
            return self._request is not None

    def defer(self, job: Callable[[], Any]) -> None:
        """Run ``job`` on the worker thread after the update in flight (now if none), before the
        next update; ``join_deferred`` waits for it."""
        if self._pool is None:
            raise RuntimeError("ZenFlowOptimizer is closed")
        self._deferred.append(self._pool.submit(job))

    def join_deferred(self) -> None:
        """Block until every deferred job is done (re-raises the first error)."""
        jobs, self._deferred = self._deferred, []
        for job in jobs:
            job.result()

    def wait(self) -> float:
        """Block until the in-flight update is done; its duration in ms (re-raises its error)."""
        future, self._future = self._future, None
        if future is None:
            return 0.0
        return future.result()

    def close(self) -> None:
        """Finish any in-flight update and stop the thread. Idempotent."""
        if self._pool is not None:
            try:
                self.wait()
                self.join_deferred()
            finally:
                self._pool.shutdown(wait=True)
                self._pool = None
