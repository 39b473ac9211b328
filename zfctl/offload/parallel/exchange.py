"""Data-parallel gradient exchange: host columns reduced to their owner only, the rest all-reduced.

Every gradient element has exactly one consumer set, and the exchange sends it only there:

* *replicated* elements (dense params, matrices the device owns whole, and the selected columns
  of the other matrices) are stepped by the device AdamW on every rank: one bucketed all-reduce,
  then division by ``W`` (the mean), ``2 (W-1)/W`` of their bytes per rank;
* *host-path* columns (a matrix's non-selected columns) are accumulated and CPU-updated by one
  owner (``partition``): they are reduce-scattered, each owner receiving the sum of its own
  columns only, then divided by ``W``; ``(W-1)/W`` of their bytes per rank.

The host-path columns of each owner are cut into rounds (``plan_rounds``) of at most
``BUCKET_BYTES / W`` per owner, and each round is one ``reduce_scatter`` (segments may be
uneven: gloo and NCCL take a list). After the exchange ``.grad`` holds the mean over ranks in
every column this rank reads (replicated ones and its owned range); the other host columns still
hold this rank's own, unreduced gradient, which nothing reads.

What used to follow for free from a full all-reduce now takes small collectives:

* the clip norm: the replicated part's sum of squares is computed identically on every rank; each
  owner adds the squares of its received columns, and one all-reduce of that partial (with, for
  the auto interval, the host columns' L1 mass per matrix) makes the global sum, the same on
  every rank;
* at a selection: the per-column L1 scores, each owner filling its own range and zeros elsewhere,
  all-reduced as one vector (x + 0 is exact, so every rank ranks the same numbers); then the
  gradients of the entering columns, which only their owner had, the same way;
* at an install: each owner broadcasts its non-selected columns (the selected ones every rank
  restores from its own device master), round by round.

Sum then divide, as the full all-reduce did: with 2 ranks every averaged element has the bits of
``g0/2 + g1/2``, i.e. of one process accumulating the two halves. Only the norm's summation order
differs (partials per owner), by rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zfctl.offload.columns.selection import column_l1
from zfctl.offload.layout import Layout, ParamSlot, as_matrix
from zfctl.offload.parallel.partition import (
    Bucket,
    Partition,
    all_reduce_buckets,
    all_reduce_bytes,
    broadcast_bytes,
    finish_buckets,
    launch_buckets,
    reduce_scatter_bytes,
)
from zfctl.offload.parallel.rounds import Cols, Rounds, ids_to_device, ids_to_host, plan_rounds


@dataclass
class _Replicated:
    """A launched all-reduce of replicated elements: the slots, the gathered items, the buckets."""

    slots: list[ParamSlot]
    items: list[tuple[ParamSlot, torch.Tensor, torch.Tensor | None]]
    buckets: list[Bucket]


@dataclass
class _Round:
    """A launched reduce-scatter round: its units, the send buffers, the output and the work."""

    units: list[list[Cols]]
    send: list[torch.Tensor]
    out: torch.Tensor
    work: Any


@dataclass
class Pending:
    """One matrix's exchange, launched and not yet completed (``GradExchange.launch``)."""

    index: int
    replicated: _Replicated
    rounds: list[_Round]


@dataclass
class Reduced:
    """What ``GradExchange.reduce`` leaves besides the averaged gradients."""

    sent: int  # bytes this rank sent (ring model, partition.py)
    sq: torch.Tensor | None  # global sum of squares of the averaged gradient (0-dim fp32), if asked
    host_mass: torch.Tensor | None  # per selectable matrix: L1 of its host-path columns, all owners


class GradExchange:
    """The collectives of one data-parallel optimizer (``Partition``) over its parameters.

    ``norm``: every step needs the global gradient norm (clipping, fp16); ``masses``: the auto
    interval may need each selectable matrix's host-path L1 mass. Both are gathered per matrix as
    its gradient is exchanged (``rep_sq``, ``host_sq``, ``mass``: one entry per slot, assigned
    when that slot is exchanged, by the hooks or by ``reduce``) and summed in slot order, so the
    hook path and the step() path give the same bits.
    """

    def __init__(self, part: Partition, layout: Layout, params: list[torch.Tensor],
                 index: list[torch.Tensor | None], device: torch.device, *, norm: bool, masses: bool) -> None:
        self.part, self.layout, self.params, self.device = part, layout, params, device
        self.index = index  # DeviceAdam.index, updated in place by selections and checkpoint loads
        self.norm, self.masses = norm, masses
        self.selectable = [s for s in layout.slots if s.selects]
        # The matrices with host columns, in the one order every rank exchanges them, here and in
        # the hook path (stream.py ExchangeOrder walks this list): reverse parameter order, the
        # order backward produces gradients in, roughly.
        self.exchange_order = sorted((s.index for s in layout.host_slots), reverse=True)
        self._pos = {s.index: i for i, s in enumerate(self.selectable)}
        host = layout.host_slots
        self.itemsize = params[host[0].index].element_size() if host else 4
        self._planned_for: list[torch.Tensor | None] | None = None
        self._rounds: Rounds = []
        n = len(layout.slots)
        self.rep_sq = torch.zeros(n, device=device)  # replicated elements' sum of squares per slot
        self.host_sq = torch.zeros(n, device=device)  # this owner's host columns' sum of squares per slot
        self.mass = torch.zeros(len(self.selectable), device=device)  # this owner's host L1 per matrix
        self.replan()

    def replan(self) -> None:
        """Plan the rounds for the current selection (``plan_rounds``: host work and two batched
        copies). Called where ``index`` changes, on the main thread: at construction, right after
        a selection inside ``step()`` (``Selector.select``) and after a load (state.py), so the
        gradient hooks of the next backward never plan (a plan there is a stream sync in the
        middle of backward, counted nowhere)."""
        self._planned_for = list(self.index)
        self._rounds = plan_rounds(self.part, self.layout, self.index, self.itemsize, self.device)

    @property
    def rounds(self) -> Rounds:
        """The rounds for the current selection. Planned by ``replan`` wherever ``index`` changes;
        planned here only for a caller that changed ``index`` without it (then in whatever
        thread asks first)."""
        if self._planned_for is None or any(a is not b for a, b in zip(self._planned_for, self.index)):
            self.replan()
        return self._rounds

    def _grad(self, index: int) -> torch.Tensor:
        g = self.params[index].grad
        assert g is not None, "reduce() and launch() give a missing gradient zeros first"
        return g

    # -- every step ---------------------------------------------------------------------------------
    def launch(self, index: int) -> Pending:
        """Start exchanging matrix ``index``'s final gradient (asynchronous collectives: its
        selected columns all-reduced, its host columns reduce-scattered round by round), exactly
        the messages ``reduce`` issues for it. The hook path (stream.py) calls it from gradient
        hooks, in ``ExchangeOrder`` on every rank; finish with :meth:`complete`."""
        slot = self.layout.slots[index]
        rep = self._launch_replicated([slot])
        rounds = []
        for rnd in self.rounds:
            units = [[u for u in owner if u.slot.index == index] for owner in rnd]
            if any(units):
                rounds.append(self._launch_round(units))
        return Pending(index, rep, rounds)

    def complete(self, pending: Pending) -> int:
        """Wait for a launched exchange (NCCL: a device-side wait of the current stream; gloo: a
        host wait) and write the averaged columns back into ``.grad``; returns bytes sent."""
        index = pending.index
        sent = self._finish_replicated(pending.replicated)
        self.host_sq[index] = 0.0
        if index in self._pos:
            self.mass[self._pos[index]] = 0.0
        for rnd in pending.rounds:
            sent += self._finish_round(rnd)
        return sent

    def average(self, done: set[int], selector: Any, stats: Any, *, masses: bool) -> tuple[Any, list | None]:
        """``reduce`` for a step: bytes sent into ``stats``; returns the global sum of squares
        and, with ``masses``, each selectable matrix's total L1 mass (``Selector.mass_totals``)."""
        red = self.reduce(done, masses=masses)
        stats.comm_bytes += red.sent
        totals = selector.mass_totals(self.params, red.host_mass) if red.host_mass is not None else None
        return red.sq, totals

    def reduce(self, done: set[int], *, masses: bool) -> Reduced:
        """Average this step's gradients to where they are read (see the module docstring).

        ``done``: params whose exchange the gradient hooks completed. The other matrices with host
        columns are exchanged one by one in ``exchange_order`` (the hooks' order and messages, so
        both paths sum every element the same way on any number of ranks), then the remaining
        replicated params in buckets. With ``norm`` (construction) or ``masses`` (this step), one
        small all-reduce more assembles the global sum of squares / the host-path L1 mass per
        selectable matrix.
        """
        for i, p in enumerate(self.params):  # a missing gradient is stepped as zeros: every rank sends
            if p.grad is None and i not in done:  # the same shapes (a done one may be released: release.py)
                p.grad = torch.zeros_like(p)
        sent = 0
        for index in self.exchange_order:
            if index not in done:
                sent += self.complete(self.launch(index))
        streamed = set(self.exchange_order)
        rest = [s for s in self.layout.slots if s.index not in done and s.index not in streamed]
        sent += self._finish_replicated(self._launch_replicated(rest))
        if not (self.norm or masses):
            return Reduced(sent, None, None)
        partial = torch.cat([self.host_sq.sum().view(1), self.mass if masses else self.mass[:0]])
        dist.all_reduce(partial, group=self.part.group)  # every owner's partials: the same sum on all ranks
        sent += all_reduce_bytes(partial.numel() * partial.element_size(), self.part.world_size)
        sq = partial[0] + self.rep_sq.sum() if self.norm else None
        return Reduced(sent, sq, partial[1:] if masses else None)

    def _launch_replicated(self, slots: list[ParamSlot]) -> _Replicated:
        """Start the all-reduce (sum) of the replicated elements of ``slots``: whole fixed params,
        selected columns (gathered: a device copy) of the others; bucketed."""
        items: list[tuple[ParamSlot, torch.Tensor, torch.Tensor | None]] = []  # (slot, data, columns)
        for s in slots:
            g, idx = self._grad(s.index), self.index[s.index]
            if s.fixed:
                items.append((s, g, None))
            elif idx is not None:  # selected columns, gathered (a device copy)
                items.append((s, as_matrix(g, s).index_select(1, idx), idx))
        buckets = launch_buckets([t for _, t, _ in items], self.part.group)
        return _Replicated(slots, items, buckets)

    def _finish_replicated(self, rep: _Replicated) -> int:
        """Wait, divide by W (the mean), write the selected columns back, note their squares."""
        sent = finish_buckets(rep.buckets, self.part.world_size, divide=True)
        for s, t, idx in rep.items:
            if idx is not None:
                as_matrix(self._grad(s.index), s).index_copy_(1, idx, t)
        if self.norm and rep.items:
            norms = torch._foreach_norm([t for _, t, _ in rep.items], 2.0, dtype=torch.float32)
            for (s, _, _), n in zip(rep.items, norms):
                self.rep_sq[s.index] = n.square()  # a device copy per slot, no sync
        for s in rep.slots:
            if not s.fixed and self.index[s.index] is None:
                self.rep_sq[s.index] = 0.0
        return sent

    def _launch_round(self, units: list[list[Cols]]) -> _Round:
        """Start one reduce-scatter: owner r will receive the sum of everyone's ``units[r]`` columns."""
        me = self.part.rank
        dtype = self._grad(next(u for owner in units for u in owner).slot.index).dtype
        send = [_gather(self._grad, owner, dtype, self.device) for owner in units]
        out = torch.empty_like(send[me])
        work = dist.reduce_scatter(out, send, group=self.part.group, async_op=True)  # sum over ranks, own segment
        return _Round(units, send, out, work)

    def _finish_round(self, rnd: _Round) -> int:
        """Wait for a reduce-scatter, divide by W, write the owned columns back into ``.grad`` and
        note their squares and L1. Returns bytes sent."""
        rnd.work.wait()
        out, me = rnd.out, self.part.rank
        out.div_(self.part.world_size)
        o = 0
        for u in rnd.units[me]:
            part = out[o : o + u.numel]
            as_matrix(self._grad(u.slot.index), u.slot).index_copy_(1, u.ids, part.view(u.slot.rows, -1))
            if self.norm:
                self.host_sq[u.slot.index] += torch.linalg.vector_norm(part, dtype=torch.float32).square()
            if self.masses and u.slot.index in self._pos:
                self.mass[self._pos[u.slot.index]] += torch.linalg.vector_norm(part, ord=1, dtype=torch.float32)
            o += u.numel
        total = sum(t.numel() for t in rnd.send) * out.element_size()
        return reduce_scatter_bytes(total, out.numel() * out.element_size())

    # -- selections ---------------------------------------------------------------------------------
    def scores(self) -> tuple[list[torch.Tensor], int]:
        """Per-column L1 of every selectable matrix's averaged gradient, identical on every rank
        (each rank scores its own column range, zeros elsewhere, one all-reduce); bytes sent."""
        sizes = [s.cols for s in self.selectable]
        flat = torch.zeros(sum(sizes), device=self.device)
        o = 0
        for s in self.selectable:
            if s.host_c1 > s.host_c0:
                g = as_matrix(self._grad(s.index), s)[:, s.host_c0 : s.host_c1]
                flat[o + s.host_c0 : o + s.host_c1] = column_l1(g)
            o += s.cols
        dist.all_reduce(flat, group=self.part.group)  # x + 0: exact
        return list(flat.split(sizes)), all_reduce_bytes(flat.numel() * 4, self.part.world_size)

    def share_entering(self, old: list[torch.Tensor | None]) -> int:
        """After a selection (``old``: the previous ``index``): every rank gets the averaged
        gradient of the columns that just entered the device, which only their owner holds (the
        owner sends them, the others zeros, one bucketed all-reduce); returns bytes sent."""
        # Which columns entered is host work on the ids: one D2H of the new and old ids of every
        # matrix, one H2D of the entering ones (a boolean mask on the device would be a sync each).
        slots = [s for s in self.selectable if self.index[s.index] is not None]
        both = ids_to_host([self.index[s.index] for s in slots] + [old[s.index] for s in slots])
        entering = []
        for s, new, prev in zip(slots, both[: len(slots)], both[len(slots) :]):
            assert new is not None  # slots holds only matrices with a selection
            ids = new if prev is None else new[~torch.isin(new, prev)]
            if ids.numel():
                entering.append((s, ids))
        on_device = ids_to_device([ids for _, ids in entering], self.device)
        picked = []
        for (s, _), ids in zip(entering, on_device):
            mine = (ids >= s.host_c0) & (ids < s.host_c1)
            t = as_matrix(self._grad(s.index), s).index_select(1, ids)
            picked.append((s, ids, t.masked_fill_(~mine, 0)))  # fill, not multiply: garbage may be inf
        sent = all_reduce_buckets([t for _, _, t in picked], self.part.group, self.part.world_size, divide=False)
        for s, ids, t in picked:
            as_matrix(self._grad(s.index), s).index_copy_(1, ids, t)
        return sent

    # -- installs -----------------------------------------------------------------------------------
    def share_installed(self) -> int:
        """Each owner broadcasts its freshly installed non-selected columns (model dtype), round by
        round, one broadcast per (round, owner); returns bytes sent (the same count on every rank).
        The selected columns every rank has already restored from its own device master."""
        me, sent = self.part.rank, 0
        for rnd in self.rounds:
            for owner, units in enumerate(rnd):
                if not units:
                    continue
                dtype = self.params[units[0].slot.index].dtype
                if owner == me:
                    buf = _gather(lambda i: self.params[i].data, units, dtype, self.device)
                else:
                    buf = torch.empty(sum(u.numel for u in units), dtype=dtype, device=self.device)
                dist.broadcast(buf, src=self.part.owner_rank(owner), group=self.part.group)
                if owner != me:
                    o = 0
                    for u in units:
                        pm = as_matrix(self.params[u.slot.index].data, u.slot)
                        pm.index_copy_(1, u.ids, buf[o : o + u.numel].view(u.slot.rows, -1))
                        o += u.numel
                sent += broadcast_bytes(buf.numel() * buf.element_size(), self.part.world_size)
        return sent


def _gather(tensor: Callable[[int], torch.Tensor], units: list[Cols], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """The columns of ``units`` (of ``tensor(slot index)``) as one flat buffer, each unit
    ``[rows, n]`` row-major: a device gather per unit, written straight into its place (no
    per-unit temporaries and no ``cat`` of them, which held the gathered bytes twice)."""
    out = torch.empty(sum(u.numel for u in units), dtype=dtype, device=device)
    o = 0
    for u in units:
        n = int(u.ids.numel())
        torch.index_select(as_matrix(tensor(u.slot.index), u.slot), 1, u.ids, out=out[o : o + u.numel].view(-1, n))
        o += u.numel
    return out
