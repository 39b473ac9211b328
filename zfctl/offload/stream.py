"""Gradients leave during backward: post-accumulate-grad hooks, a copy stream, a host landing buffer
and an accumulation thread. This is the hook path's device to host copy (the step() path's is
chunks.py ``offload_gradients``, the device path's device_acc.py ``copy_out``).

The last backward of an optimizer step (the loop says which: ``ZenFlowOptimizer.prepare_backward``)
arms the stream. From then on, as soon as autograd has finished a matrix's ``.grad`` (its
post-accumulate-grad hook), the hook

1. (data parallel) starts that gradient's exchange over the ranks (``GradExchange.launch``: its
   selected columns all-reduced, its host columns reduce-scattered to their owners), asynchronously,
   and in one fixed order on every rank (``ExchangeOrder``): a hook that fires out of that order
   only marks its matrix ready, and a matrix that gets no gradient in this backward holds back
   the ones after it until step(), which exchanges the rest in the same order. So every rank
   issues the same collectives in the same sequence whatever its hooks did. An exchange is
   completed (``GradExchange.complete``: a device-side wait, then the averaged columns written
   back into ``.grad``) one hook later, so the collective overlaps the next matrix's backward;
2. transposes each host-owned column range of the (averaged) gradient into a fresh column-major
   device temporary on the compute stream, and copies it on the copy stream into the *landing*
   buffer, the host mirror of the accumulator's layout in the model dtype (PCIe D2H, 2 B per
   element for bf16). The temporary is always a new buffer, never a view of ``.grad``: a by-row
   matrix's column range is already contiguous, and copying ``.grad`` itself would race with
   anything that writes it before the copy lands (``zero_grad(set_to_none=False)``, a next
   backward);
3. hands the chunk to the accumulation thread, if the gradient coefficient is known already.

The coefficient (clip factor / fp16 loss scale) is known only once every gradient exists, so
with clipping or fp16 the hooks only move bytes: the landing buffer keeps the step's raw
gradient, and ``finish`` (inside step(), once the coefficient is on the host) queues ONE job on
the accumulation thread that adds ``coef * landing`` into the accumulator, chunk by chunk, with
the same native kernel, the same inputs and the same rounding as the step() path (``acc += coef *
grad``, one fma per element). The result is therefore bit-identical to the step() path, and the
host add runs while the device does the next forward. Without clipping and fp16 the
coefficient is 1 and the thread adds each chunk as soon as its copy has landed, during backward.
A matrix whose hook did not land it (no gradient in this backward, or held back by the exchange
order) is landed by ``finish`` from step() itself, so no gradient is ever left out.

Buffers and owners (docs/design.md, "Threads and buffer ownership"):

| buffer | written by | read by | released when |
| --- | --- | --- | --- |
| device temporaries | compute stream (transpose) | copy stream | the copy's event (``record_stream``); at most ``budget_bytes`` in flight, across steps |
| landing[w] (page-locked, exact size) | copy stream | accumulation thread | that window's last job is done (``fences[w]``) |
| landing ring slot j (release_grads; page-locked, exact size) | copy stream | accumulation thread | that slot's job is done (``ring_fences[j]``), waited for by the hook that reuses it |
| the accumulator (``Pipeline.acc``) | accumulation thread, in job order | CPU worker at a boundary | the worker waits for the boundary step's fence |

Two landing buffers alternate by window, so the hooks of step t+1 wait only for the jobs of
step t-1 (normally long done); that wait, and waits for the bound on device temporaries in
flight (``budget_bytes``, counted across steps: the copies of one step may outlast the next
backward at 7B), happen on the hook's thread and are reported as stall. Cost: host memory of 2 x
(matrix elements) x (model itemsize), page-locked; device memory of at most ``budget_bytes`` of
temporaries.

With ``zenflow.tuning.release_grads`` (release.py owns the hooks then and calls ``on_grad``) the
coefficient the hooks add with is always known (1 / the fp16 loss scale; the clip factor waits
for the boundary), so there are no full landing buffers: each chunk lands in the next slot of a
ring of chunk-sized slots (as many as the device budget holds, at least two), the thread adds it
as soon as its copy has landed, and a hook that reuses a slot first waits for the job that read
it (``ring_fences``, stall). Host memory: the ring, whatever the model's size. After each landing
``on_final`` tells release.py that the param's ``.grad`` may be taken and freed.

On FSDP2 shards (``distributed.strategy: fsdp``) the hooks are the sharded DTensors', which FSDP2
calls once it has reduce-scattered each layer, on the stream that wrote ``.grad`` (sharded.py
``hook_grads``, docs/design.md "ZenFlow on FSDP2 shards"); the rest is this code.

Without CUDA the same code runs synchronously: the hook copies straight into the landing buffer
and, when the coefficient is known, accumulates at once (that is how CI tests the logic).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zfctl.offload import pinned
from zfctl.offload.acc_gate import AccGate, Waiter
from zfctl.offload.chunks import Chunk
from zfctl.offload.layout import as_matrix
from zfctl.offload.ledger import NOWHERE, Ledger
from zfctl.offload.pcie import bind_device, copy_async
from zfctl.offload.stats import StepStats

Accumulate = Callable[..., None]


class ExchangeOrder:
    """Walks the one order in which every rank exchanges the streamed matrices (the exchange's own
    ``exchange_order``, which ``reduce`` follows too). ``ready(index)`` returns the matrices that
    may be exchanged now: the next ones in the order whose gradients are all final."""

    def __init__(self, order: list[int]) -> None:
        self.order = list(order)
        self.reset()

    def reset(self) -> None:
        self._ready: set[int] = set()
        self._next = 0

    def ready(self, index: int) -> list[int]:
        self._ready.add(index)
        out = []
        while self._next < len(self.order) and self.order[self._next] in self._ready:
            out.append(self.order[self._next])
            self._next += 1
        return out


class GradStream:
    """Moves the host-owned gradient columns to the host during the last backward of a step."""

    ledger: Ledger = NOWHERE  # where its bytes and waits are counted (ledger.py; the optimizer's own)

    def __init__(self, params: list[torch.Tensor], slots: list[Any], *, numel: int, dtype: torch.dtype,
                 device: torch.device, pin_memory: bool, budget_bytes: int, accumulate: Accumulate,
                 exchange: Any = None, gate: AccGate | None = None, ring_slots: int = 0, slot_bytes: int = 0,
                 hooks: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.params = params
        pin = pin_memory and self.cuda
        # Where the D2H copies land. Two full landing buffers (one per window, a step's raw
        # gradient waits there for its coefficient), or, with ``ring_slots`` (release_grads: the
        # coefficient the hooks add with is always known), a ring of that many chunk-sized slots,
        # each reused once the thread has added the chunk it held: host memory independent of
        # the model's size.
        self.landing = [] if ring_slots else [pinned.empty(numel, dtype, pin=pin, device=device) for _ in range(2)]
        self.fences: list[Future | None] = [None, None]  # the last job that reads landing[w]
        self.ring = pinned.empty(ring_slots * slot_bytes, torch.uint8, pin=pin, device=device)
        self.ring_slots, self.slot_bytes = ring_slots, slot_bytes
        self.ring_fences: list[Future | None] = [None] * ring_slots  # the job that reads ring slot j
        self._next_slot = 0
        # release.py: called with each param index whose host columns a hook has just landed (after
        # its exchange, data parallel), so its ``.grad`` can be taken and freed.
        self.on_final: Callable[[int], None] | None = None
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.budget_bytes = budget_bytes
        self._accumulate = accumulate
        self._gate = gate  # one host accumulator: first writes wait for the CPU update (acc_gate.py)
        self._exchange = exchange  # data parallel: exchange.GradExchange (launch / complete)
        self._order = ExchangeOrder(exchange.exchange_order) if exchange is not None else None
        # The thread binds itself to the optimizer's device first: its event waits would otherwise
        # create a CUDA context on GPU 0 (pcie.bind_device).
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, thread_name_prefix="zenflow-acc", initializer=bind_device, initargs=(device,))
        self._last_job: Future | None = None
        self._w = 1  # the landing buffer of the current window (the first window takes 0)
        # Device temporaries whose D2H may still run, with their bytes: kept across windows, since
        # the copies of one step may outlast the next step's forward (the budget must see them).
        self.inflight: deque[tuple[Any, int]] = deque()
        self.inflight_bytes = 0
        # With release_grads the hooks are release.py's, which calls ``on_grad`` itself.
        self._handles = [params[s.index].register_post_accumulate_grad_hook(self._hook_for(s.index))
                         for s in slots] if hooks else []
        self.armed = False
        self._reset_window()

    # -- the window of one backward --------------------------------------------------------------
    def _reset_window(self) -> None:
        self.chunks: dict[int, list[Chunk]] = {}
        self.acc: torch.Tensor | None = None
        self.coef: float | None = None  # known before backward (no clip, no fp16): 1.0
        self.first = False  # the interval's first step: write the accumulator, do not add
        self.wait_read: Waiter | None = None  # first step: the wait before overwriting a chunk
        self.landed: list[tuple[Chunk, Any, torch.Tensor]] = []  # (chunk, copy event or None, its landing view)
        self.landed_params: set[int] = set()  # params whose chunks have been copied this window
        self.exchanged: set[int] = set()  # params whose exchange over ranks is complete
        self._launched: deque[tuple[int, Any]] = deque()  # (param, pending exchange), in order
        self.seen: set[int] = set()  # params whose final gradient this window has taken
        self.jobs: list[Future] = []  # CUDA, coefficient known: one job per chunk
        self.early_accumulated = 0  # chunks added in the hook (CPU, coefficient known)
        self.budget_waits = 0  # times a hook waited for the bound on temporaries in flight
        self.comm_bytes = 0  # data parallel: bytes this rank sent in the hooks' collectives
        self.wait_ms = 0.0  # host waits on the hook thread (stall)
        self.started = False
        if self._order is not None:  # data parallel
            self._order.reset()

    def arm(self, chunks: list[Chunk], acc: torch.Tensor, coef: float | None, *, first: bool) -> None:
        """Stream the next backward's final gradients; ``coef`` known in advance, else None;
        ``first``: the interval's first step (``acc`` is written, not added to)."""
        if self.ring_slots and coef is None:
            raise ValueError("a landing ring reuses its slots at once: the hooks need the coefficient")
        self._reset_window()
        for ch in chunks:
            self.chunks.setdefault(ch.slot.index, []).append(ch)
        self.acc, self.coef, self.first, self.armed = acc, coef, first, True
        # Taken now, in step order (the update submitted last), not when a job runs (acc_gate.py).
        self.wait_read = self._gate.waiter() if first and self._gate is not None else None

    def disarm(self) -> None:
        """The next backward is not the last of the step (or the hook path is off for it)."""
        self.armed = False
        self._reset_window()

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if self.armed:
                self.on_grad(index, p)

        return hook

    @torch.no_grad()
    def on_grad(self, index: int, p: torch.Tensor) -> None:
        """Param ``index``'s gradient of the armed backward is final (its hook)."""
        if index in self.seen:  # a second backward in one window would add its gradient twice
            raise RuntimeError("ZenFlowOptimizer.prepare_backward(final=True) announces ONE backward: call "
                               "step() after it (earlier micro-batches take final=False)")
        self.seen.add(index)
        assert p.grad is not None  # a post-accumulate-grad hook runs once the gradient exists
        self._start_window()
        if self._exchange is None or self._order is None:
            self._land(index)
            if self.on_final is not None:
                self.on_final(index)
            return
        for i in self._order.ready(index):  # collectives in the one order every rank uses
            self._launched.append((i, self._exchange.launch(i)))
            # Complete all but the newest exchange: it overlaps the next matrix's backward. Inside
            # the loop: a hook that releases held-back matrices keeps at most two exchanges (their
            # gathered buffers) pending, what the plan counts (zfctl/plan/memory.py).
            while len(self._launched) > 1:
                self._complete_oldest()

    def _start_window(self) -> None:
        if self.started:
            return
        self.started = True  # first hook of the window: landing[w] must be free again
        if not self.cuda and self.coef is not None and self._last_job is not None:
            # CPU, coefficient known: this window's hooks add on the training thread (_land), so
            # the jobs queued on the accumulation thread before them (the zero sum of an interval's
            # first step, a late add) must be done first: they write the same accumulator ranges.
            t0 = time.perf_counter()
            with self.ledger.waiting("host.hook_slot"):
                self._last_job.result()  # host wait (stall), at most once per window
            self.wait_ms += (time.perf_counter() - t0) * 1e3
        if self.ring_slots:  # the ring's slots are waited for one by one (_ring_view)
            return
        self._w = 1 - self._w
        fence = self.fences[self._w]
        if fence is not None:  # written every window; blocks only when the job is late
            t0 = time.perf_counter()
            with self.ledger.waiting("host.hook_slot"):
                fence.result()  # host wait: the accumulation of two steps ago still reads it
            self.wait_ms += (time.perf_counter() - t0) * 1e3

    def _complete_oldest(self) -> None:
        assert self._exchange is not None
        i, pending = self._launched.popleft()
        self.comm_bytes += self._exchange.complete(pending)  # device-side wait, then the write-back
        self.exchanged.add(i)
        self._land(i)
        if self.on_final is not None:
            self.on_final(i)

    def replan(self, chunks: list[Chunk]) -> None:
        """A selection inside this window re-planned the chunks (release.py): the params no hook
        has landed yet are landed by ``finish`` with the new ones."""
        new: dict[int, list[Chunk]] = {}
        for ch in chunks:
            new.setdefault(ch.slot.index, []).append(ch)
        for index in set(self.chunks) | set(new):
            if index not in self.landed_params:
                self.chunks[index] = new.get(index, [])

    def complete_exchanges(self) -> set[int]:
        """Inside step(): finish the exchanges the hooks started (in order); returns every param
        whose exchange is complete (step() exchanges the others, in the same order)."""
        while self._launched:
            self._complete_oldest()
        return self.exchanged

    def _land(self, index: int) -> None:
        """Copy the host-owned chunks of param ``index``'s final gradient into the landing buffer."""
        grad = self.params[index].grad
        chunks = self.chunks.get(index, ())
        if grad is None or not chunks:
            return
        self.landed_params.add(index)
        gm = as_matrix(grad, chunks[0].slot)
        assert self.acc is not None  # arm() gave the accumulator
        for ch in chunks:
            j = self._next_slot % self.ring_slots if self.ring_slots else None
            dst = self._landing_view(ch, grad.dtype, j)
            nbytes = ch.numel * dst.element_size()
            self.ledger.moved("d2h.grad", nbytes)  # PCIe D2H (CPU: what would cross it) ...
            self.ledger.moved("host.land", nbytes)  # ... written into the landing buffer / ring slot
            if not self.cuda:
                dst.view(ch.c1 - ch.c0, ch.slot.rows).copy_(gm[:, ch.c0 : ch.c1].t())
                self.landed.append((ch, None, dst))
                if self.coef is not None:
                    self._add(ch, None, dst, self.acc, self.coef, self.first, self.wait_read)
                    self.early_accumulated += 1
                continue
            self._make_room(ch.numel * dst.element_size())
            assert self.copy_stream is not None  # CUDA: created in __init__
            compute = torch.cuda.current_stream(self.device)
            # compute stream: a fresh column-major buffer (``empty`` + ``copy_``, never ``contiguous()``,
            # which returns ``.grad`` itself when the range is contiguous already: a by-row matrix)
            tmp = torch.empty((ch.c1 - ch.c0, ch.slot.rows), dtype=grad.dtype, device=self.device)
            tmp.copy_(gm[:, ch.c0 : ch.c1].t())
            event = copy_async(self.copy_stream, dst, tmp.view(-1), after=compute)  # PCIe D2H of one chunk
            tmp.record_stream(self.copy_stream)  # the temporary lives until its copy is done
            self.inflight.append((event, tmp.numel() * tmp.element_size()))
            self.inflight_bytes += self.inflight[-1][1]
            self.landed.append((ch, event, dst))
            if self.coef is not None:  # the thread adds it as soon as the copy has landed
                self._last_job = self._submit(self._add, ch, event, dst, self.acc, self.coef, self.first,
                                              self.wait_read)
                if j is None:
                    self.fences[self._w] = self._last_job
                else:
                    self.ring_fences[j] = self._last_job
                self.jobs.append(self._last_job)

    def _landing_view(self, ch: Chunk, dtype: torch.dtype, j: int | None) -> torch.Tensor:
        """Where chunk ``ch`` lands: its range of the window's landing buffer, or ring slot ``j``
        once the job that read it last is done (a host wait on the hook's thread: stall)."""
        if j is None:
            return self.landing[self._w][ch.off : ch.off + ch.numel]
        self._next_slot += 1
        fence, self.ring_fences[j] = self.ring_fences[j], None
        if fence is not None:  # written for every reused slot; blocks only when the job is late
            t0 = time.perf_counter()
            with self.ledger.waiting("host.hook_slot"):
                fence.result()  # host wait: the thread is still adding what slot j held
            self.wait_ms += (time.perf_counter() - t0) * 1e3
        nbytes = ch.numel * dtype.itemsize
        assert nbytes <= self.slot_bytes, "chunks are planned to fit one ring slot (chunks.plan_chunks)"
        return self.ring[j * self.slot_bytes : j * self.slot_bytes + nbytes].view(dtype)

    def _make_room(self, nbytes: int) -> None:
        """Bound the device temporaries in flight: wait for the oldest copies (stall)."""
        while self.inflight and self.inflight_bytes + nbytes > self.budget_bytes:
            event, b = self.inflight.popleft()
            with self.ledger.waiting("host.hook_budget"):  # over budget: this copy must have landed
                landed = event.query()
                if not landed:
                    t0 = time.perf_counter()
                    event.synchronize()  # sync point: one earlier chunk's D2H
                    self.wait_ms += (time.perf_counter() - t0) * 1e3
                    self.budget_waits += 1
            self.inflight_bytes -= b

    def _submit(self, fn: Callable[..., None], *args: Any) -> Future:
        """Queue ``fn(*args)`` on the accumulation thread (which runs jobs in submission order)."""
        assert self._pool is not None, "GradStream used after close()"
        return self._pool.submit(self.ledger.charged(fn), *args)  # its bytes: the issuing step's

    def _add(self, ch: Chunk, event: Any, src: torch.Tensor, acc: torch.Tensor, coef: float,
             first: bool, wait_read: Waiter | None = None) -> None:
        if event is not None:
            event.synchronize()  # accumulation thread: that chunk's D2H has landed
        if wait_read is not None:
            wait_read(ch.off)  # one accumulator: the CPU update in flight has read this chunk
        self._accumulate(acc[ch.off : ch.off + ch.numel], src, scale=coef, runs=ch.runs, overwrite=first)

    # -- inside step() -----------------------------------------------------------------------------
    def finish(self, stats: StepStats, coef: float | None, itemsize: int) -> Future | None:
        """Close the window: land what no hook landed, queue the late accumulation (``coef``: the
        step's coefficient), record what left the device early, and return the fence the
        boundary's CPU update must wait for. ``coef=None``: the step was skipped (fp16 overflow),
        the landed gradient is dropped."""
        early = len(self.landed)
        stats.early_chunks = early
        stats.early_bytes = sum(ch.numel for ch, _, _ in self.landed) * itemsize
        if coef is not None:  # matrices no hook landed: their gradient now, from step() (stall)
            t0 = time.perf_counter()
            self._start_window()
            for index in sorted(self.chunks):
                if index not in self.landed_params:
                    self._land(index)
            self.wait_ms += (time.perf_counter() - t0) * 1e3
            stats.in_step_chunks += len(self.landed) - early
            stats.in_step_bytes += sum(ch.numel for ch, _, _ in self.landed[early:]) * itemsize
        stats.stall_ms += self.wait_ms
        stats.comm_bytes += self.comm_bytes
        w = self._w
        acc, first, wait_read = self.acc, self.first, self.wait_read
        if first and coef is not None:  # matrices without a gradient this step: a zero sum
            got = {id(ch) for ch, _, _ in self.landed}
            missing = [ch for chs in self.chunks.values() for ch in chs if id(ch) not in got]
            if missing:
                assert acc is not None  # chunks exist only in an armed window, which has its accumulator

                def zero() -> None:
                    for ch in missing:
                        if wait_read is not None:
                            wait_read(ch.off)
                        acc[ch.off : ch.off + ch.numel].zero_()

                self._last_job = self._submit(zero)  # the thread owns acc: keep its order
        if self.coef is None and coef is not None and self.landed:
            landed = list(self.landed)
            assert acc is not None  # chunks land only in an armed window, which has its accumulator

            def job() -> None:
                for ch, event, src in landed:
                    self._add(ch, event, src, acc, coef, first, wait_read)

            self._last_job = self._submit(job)
            self.fences[w] = self._last_job
            stats.accumulated_late = len(landed)
        elif self.coef is not None:
            # CPU: exact (added in the hook). CUDA: how many the thread had finished when step()
            # got here, informative only (the rest finishes while the next forward runs).
            stats.accumulated_early = self.early_accumulated + sum(f.done() for f in self.jobs)
        stats.budget_waits += self.budget_waits
        self.armed = False
        fence = self._last_job
        self._reset_window()
        return fence

    def drain(self) -> None:
        """Wait for every queued accumulation (checkpoints, loading, closing)."""
        if self._last_job is not None:
            with self.ledger.waiting("host.acc_drain"):
                self._last_job.result()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._pool is not None:
            try:
                self.drain()
            finally:
                self._pool.shutdown(wait=True)
                self._pool = None
        while self.inflight:  # copies into the landing buffers must land before they are unpinned
            self.inflight.popleft()[0].synchronize()
        self.inflight_bytes = 0
        for buf in (*self.landing, self.ring):
            pinned.release(buf)
