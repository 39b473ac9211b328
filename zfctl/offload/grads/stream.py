"""Gradients land in the step's slot: post-accumulate-grad hooks during the last backward, or
step() itself, through one copy stream. This is the host paths' only device to host gradient copy
(the device path's is device_acc.py ``copy_out``, once per interval).

The last backward of an optimizer step (the loop says which: ``ZenFlowOptimizer.prepare_backward``)
arms the stream with the step's slot (slots.py). From then on, as soon as autograd has finished a
matrix's ``.grad`` (its post-accumulate-grad hook), the hook

1. (data parallel) starts that gradient's exchange over the ranks (``GradExchange.launch``: its
   selected columns all-reduced, its host columns reduce-scattered to their owners), asynchronously,
   and in one fixed order on every rank (``ExchangeOrder``): a hook that fires out of that order
   only marks its matrix ready, and a matrix that gets no gradient in this backward holds back
   the ones after it until step(), which exchanges the rest in the same order. So every rank
   issues the same collectives in the same sequence whatever its hooks did. An exchange is
   completed (``GradExchange.complete``: a device-side wait, then the averaged columns written
   back into ``.grad``) one hook later, so the collective overlaps the next matrix's backward;
2. transposes each host-owned column range of the (averaged) gradient into a fresh column-major
   device temporary on the compute stream, and copies it on the copy stream into its place in the
   slot (PCIe D2H, model dtype: 2 B per element for bf16). The temporary is always a new buffer,
   never a view of ``.grad``: a by-row matrix's column range is already contiguous, and copying
   ``.grad`` itself would race with anything that writes it before the copy lands
   (``zero_grad(set_to_none=False)``, a next backward).

That is all: no coefficient is needed (step() records it with the slot once it has it) and no host
thread adds anything. ``finish`` (inside step()) lands what no hook landed: every matrix on the
step() path (no announced final backward, a selection step, loss scaling under the carry layout),
else a matrix
whose hook did not fire in the final backward (its gradient came from an earlier micro-batch).
A matrix without any gradient writes ``-0.0`` into its chunks: ``fma(-0, c, a) == a`` for every
``a``, so its step adds nothing, as the per-step accumulation skipped it.

Buffers and owners (docs/design.md, "Threads and buffer ownership"):

| buffer | written by | read by | released when |
| --- | --- | --- | --- |
| device temporaries | compute stream (transpose) | copy stream | the copy's event (``record_stream``); at most ``budget_bytes`` in flight, across steps |
| the step's slot (page-locked, slots.py) | copy stream (a chunk's D2H); the main thread's ``-0.0`` fill, after the last copy's event | the CPU worker at the boundary, after ``fence()`` | the set's next interval (two sets), or behind the worker's watermark (one set, acc_gate.py) |
| the carry layout's landing ring slot (page-locked, carry.py) | copy stream (a chunk's D2H), into a free slot (the issuing thread waits for one) | the fold thread, after the copy's event; it folds the chunk into the carry | after its fold |
| the carry (page-locked fp32, carry.py) | the fold thread (folds; a missing gradient's ``+0`` on an interval's first step) | the CPU worker at the boundary, after ``fence()`` (the last fold) | behind the worker's watermark with overlap (acc_gate.py, as one set) |

The bound on device temporaries in flight (``budget_bytes``, counted across steps: the copies of
one step may outlast the next backward at 7B) makes a hook wait for the oldest copy's event, on
the hook's thread (stall). With one slot set and ``overlap_step`` each write (a copy, a fill) first
waits until the CPU update of the previous interval has read that piece (``wait_read``, on the
thread that issues it). Nothing else waits: the hooks never wait for host work.

On FSDP2 shards (``distributed.strategy: fsdp``) the hooks are the sharded DTensors', which FSDP2
calls once it has reduce-scattered each layer, on the stream that wrote ``.grad`` (sharded.py
``hook_grads``, docs/design.md "ZenFlow on FSDP2 shards"); the rest is this code. With
``zenflow.tuning.release_grads`` the hooks are release.py's, which calls ``on_grad`` and is told
through ``on_final`` when a param's ``.grad`` may be taken and freed.

Without CUDA the same code runs synchronously: each copy is a plain host copy into the slot (that is
how CI tests the logic); under the carry layout the chunk is folded at once, on the same thread.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from zfctl.offload.device.chunks import Chunk
from zfctl.offload.device.pcie import copy_async
from zfctl.offload.grads.acc_gate import Waiter
from zfctl.offload.grads.carry import GradCarry
from zfctl.offload.layout import as_matrix
from zfctl.offload.ledger import NOWHERE, Ledger
from zfctl.offload.stats import StepStats


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
    """Lands the host-owned gradient columns of a step in its slot: from the hooks of the last
    backward (armed), or from step() (``finish``)."""

    ledger: Ledger = NOWHERE  # where its bytes and waits are counted (ledger.py; the optimizer's own)

    def __init__(self, params: list[torch.Tensor], slots: list[Any], *, device: torch.device, budget_bytes: int,
                 exchange: Any = None, hooks: bool = True, carry: GradCarry | None = None) -> None:
        self.cuda = device.type == "cuda"
        # The carry layout (carry.py): each chunk lands in a ring slot and is folded into the
        # carry with the step's (u, overwrite), taken when the window opens; None: the slots layout.
        self.carry = carry
        self.fold_args = (1.0, False)
        self.device = device
        self.params = params
        # release.py: called with each param index whose host columns a hook has just landed (after
        # its exchange, data parallel), so its ``.grad`` can be taken and freed.
        self.on_final: Callable[[int], None] | None = None
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.budget_bytes = budget_bytes
        self._exchange = exchange  # data parallel: exchange.GradExchange (launch / complete)
        self._order = ExchangeOrder(exchange.exchange_order) if exchange is not None else None
        # The event after the last copy into a slot (CUDA): the copies queue in order on one
        # stream, so it also means every earlier one has landed. The CPU worker's fence.
        self.last: Any = None
        # Device temporaries whose D2H may still run, with their bytes: kept across windows, since
        # the copies of one step may outlast the next step's forward (the budget must see them).
        self.inflight: deque[tuple[Any, int]] = deque()
        self.inflight_bytes = 0
        # With release_grads (or FSDP2 shards) the hooks are someone else's, which call ``on_grad``.
        self._handles = [params[s.index].register_post_accumulate_grad_hook(self._hook_for(s.index))
                         for s in slots] if hooks else []
        self.armed = False
        self._reset_window()

    # -- the window of one step ------------------------------------------------------------------
    def _reset_window(self) -> None:
        self.chunks: dict[int, list[Chunk]] = {}
        self.dst: torch.Tensor | None = None  # the step's slot
        self.wait_read: Waiter | None = None  # one slot set: the wait before writing a piece
        self.landed: list[Chunk] = []  # chunks copied into the slot this window, in order
        self.landed_params: set[int] = set()  # params whose chunks have been copied this window
        self.exchanged: set[int] = set()  # params whose exchange over ranks is complete
        self._launched: deque[tuple[int, Any]] = deque()  # (param, pending exchange), in order
        self.seen: set[int] = set()  # params whose final gradient this window has taken
        self.budget_waits = 0  # times a hook waited for the bound on temporaries in flight
        self.comm_bytes = 0  # data parallel: bytes this rank sent in the hooks' collectives
        self.wait_ms = 0.0  # host waits on the hook thread (stall)
        if self._order is not None:  # data parallel
            self._order.reset()

    def open(self, chunks: list[Chunk], dst: torch.Tensor, wait_read: Waiter | None) -> None:
        """Start a step's window: ``chunks`` land in ``dst`` (the step's slot); ``wait_read``: one
        slot set with overlap, the wait before each write (acc_gate.py; its ticket is taken by the
        caller in step order)."""
        self._reset_window()
        for ch in chunks:
            self.chunks.setdefault(ch.slot.index, []).append(ch)
        self.dst, self.wait_read = dst, wait_read
        if self.carry is not None:
            self.fold_args = self.carry.step_fold()

    def arm(self, chunks: list[Chunk], dst: torch.Tensor, wait_read: Waiter | None = None) -> None:
        """Stream the next backward's final gradients into ``dst`` from their hooks."""
        self.open(chunks, dst, wait_read)
        self.armed = True

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
        if index in self.seen:  # a second backward in one window would land its gradient twice
            raise RuntimeError("ZenFlowOptimizer.prepare_backward(final=True) announces ONE backward: call "
                               "step() after it (earlier micro-batches take final=False)")
        self.seen.add(index)
        assert p.grad is not None  # a post-accumulate-grad hook runs once the gradient exists
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
        """Copy the host-owned chunks of param ``index``'s final gradient into the step's slot."""
        grad = self.params[index].grad
        chunks = self.chunks.get(index, ())
        if grad is None or not chunks:
            return
        self.landed_params.add(index)
        gm = as_matrix(grad, chunks[0].slot)
        dst = self.dst
        assert dst is not None  # open() gave the slot
        for ch in chunks:
            if self.wait_read is not None:
                self.wait_read(ch.off)  # one slot set (or the carry): the update in flight has read this piece
            ring = self.carry.folds.slot(ch.numel) if self.carry is not None else None  # carry.py: a ring slot
            view = ring[1] if ring is not None else dst[ch.off : ch.off + ch.numel]
            self.landed.append(ch)
            nbytes = ch.numel * view.element_size()
            self.ledger.moved("d2h.grad", nbytes)  # PCIe D2H (CPU: what would cross it) ...
            self.ledger.moved("host.land", nbytes)  # ... written into the step's slot (carry: a ring slot)
            if not self.cuda:
                view.view(ch.c1 - ch.c0, ch.slot.rows).copy_(gm[:, ch.c0 : ch.c1].t())
                self._fold(ring, ch, None)
                continue
            self._make_room(ch.numel * view.element_size())
            assert self.copy_stream is not None  # CUDA: created in __init__
            compute = torch.cuda.current_stream(self.device)
            # compute stream: a fresh column-major buffer (``empty`` + ``copy_``, never ``contiguous()``,
            # which returns ``.grad`` itself when the range is contiguous already: a by-row matrix)
            tmp = torch.empty((ch.c1 - ch.c0, ch.slot.rows), dtype=grad.dtype, device=self.device)
            tmp.copy_(gm[:, ch.c0 : ch.c1].t())
            self.last = copy_async(self.copy_stream, view, tmp.view(-1), after=compute)  # PCIe D2H of one chunk
            tmp.record_stream(self.copy_stream)  # the temporary lives until its copy is done
            self.inflight.append((self.last, tmp.numel() * tmp.element_size()))
            self.inflight_bytes += self.inflight[-1][1]
            self._fold(ring, ch, self.last)  # carry: the fold thread waits for this copy's event

    def _fold(self, ring: tuple[int, torch.Tensor] | None, ch: Chunk, event: Any) -> None:
        """The carry layout: fold the chunk landed in ring slot ``ring`` (once ``event`` fired)
        into the carry at ``ch.off`` (carry.py); nothing on the slots layout."""
        if self.carry is not None and ring is not None:
            u, overwrite = self.fold_args
            self.carry.folds.fold(event, ring[0], ch.off, ch.numel, u, overwrite)

    def _fill(self, chunks: list[Chunk]) -> None:
        """A param without a gradient this step: ``-0.0`` into its chunks of the slot (host writes,
        the additive identity of the worker's fma chain). On CUDA after the last copy's event: a
        skipped fp16 step may have left a copy into the same range in flight (a host wait, for a
        missing gradient only)."""
        dst = self.dst
        assert dst is not None
        if self.carry is not None:  # carry.py: nothing to add, but +0 on an interval's first step
            u, overwrite = self.fold_args
            for ch in chunks:
                if self.wait_read is not None:
                    self.wait_read(ch.off)
                self.carry.folds.fold(None, None, ch.off, ch.numel, u, overwrite)
            return
        if chunks and self.last is not None:
            t0 = time.perf_counter()
            with self.ledger.waiting("host.slot_fill"):
                self.last.synchronize()  # sync point: earlier copies into this slot have landed
            self.wait_ms += (time.perf_counter() - t0) * 1e3
        for ch in chunks:
            if self.wait_read is not None:
                self.wait_read(ch.off)
            dst[ch.off : ch.off + ch.numel].fill_(-0.0)
            self.ledger.moved("host.land", ch.numel * dst.element_size())  # written into the slot, no PCIe

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

    # -- inside step() -----------------------------------------------------------------------------
    def finish(self, stats: StepStats, itemsize: int) -> None:
        """Close the window: land what no hook landed (from step(): stall), ``-0.0`` for params
        without a gradient, and record what left the device early and what step() moved."""
        early = len(self.landed)
        stats.early_chunks += early
        stats.early_bytes += sum(ch.numel for ch in self.landed) * itemsize
        t0 = time.perf_counter()
        missing: list[Chunk] = []
        for index in sorted(self.chunks):
            if index not in self.landed_params:
                if self.params[index].grad is None:
                    missing.extend(self.chunks[index])
                else:
                    self._land(index)
        self._fill(missing)
        self.wait_ms += (time.perf_counter() - t0) * 1e3
        stats.in_step_chunks += len(self.landed) - early
        stats.in_step_bytes += sum(ch.numel for ch in self.landed[early:]) * itemsize
        stats.stall_ms += self.wait_ms
        stats.comm_bytes += self.comm_bytes
        stats.budget_waits += self.budget_waits
        self.armed = False
        self._reset_window()

    def skip(self) -> None:
        """The step was skipped (fp16 overflow): what landed is dropped; the next step rewrites
        the same slot (its copies queue after these on the copy stream). The carry layout lands
        nothing before the overflow check (carry.py): a fold cannot be taken back."""
        assert self.carry is None or not self.landed, "carry layout: no fold before the overflow check"
        self.armed = False
        self._reset_window()

    def fence(self) -> Callable[[], None] | None:
        """The wait the CPU worker does before it reads the slots written so far: the last copy's
        event (None on CPU, where every copy is synchronous); the carry layout: the last fold
        issued (carry.py, which comes after its copy)."""
        if self.carry is not None:
            return self.carry.folds.fence()
        last = self.last
        return last.synchronize if last is not None else None

    def drain(self) -> None:
        """Host wait until every copy into a slot has landed (checkpoints, loading, closing)."""
        if self.last is not None:
            with self.ledger.waiting("host.slot_drain"):
                self.last.synchronize()
        if self.carry is not None:
            self.carry.folds.drain()  # and every fold into the carry (carry.py)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        while self.inflight:  # copies into the slots must land before they are unpinned
            self.inflight.popleft()[0].synchronize()
        self.inflight_bytes = 0
        if self.carry is not None:
            self.carry.folds.close()  # the folds of those copies, then the fold thread stops
