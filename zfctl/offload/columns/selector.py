"""When the device's columns are chosen, and choosing them: the selection schedule and its step.

Selection happens at step ``t == W`` (the end of the full warm-up) and then every select period
(``zenflow.select_interval``: steps, or epochs of ``steps_per_epoch``; ``ZenFlowConfig.select_period``).
Each matrix keeps its top ``k`` columns scored by the L1 norm of that step's raw gradient (the
coefficient is one positive factor and does not change the ranking), and the state of entering
and leaving columns migrates between the host and the device.

The step does not drain the CPU pipeline. The update submitted at the boundary one step earlier
may still run: it owns the host rows of the columns that were host-owned when it was submitted,
and never touches the rows of the device-owned ones. So the selection (1) brings the new column
ids to the host (one D2H, one host wait), (2) plans every matrix at once (selection.py
``plan_selection``), (3) asks the worker to update the entering columns first, without waiting
(``Pipeline.request``), (4) enqueues the leaving and staying moves (migration.py: asynchronous
DMA; the leaving columns' rows were device-owned during that update, so the worker writes them
behind it) and hands the worker the fill, which gathers the entering rows into the in ring once
they are updated (``Pipeline.hand``). The caller re-plans the column chunks (device-owned
columns changed) while the worker fills, then ``arrive`` waits for the fill (one host wait) and
has the compute stream wait for the migration. The rest of the update installs on the ordinary
schedule (pipeline.py).

Data parallel: the scores come from every owner (one all-reduce, exchange.py), the state of an
entering column from its owner (partition.py ``OwnedRows``, blocking collectives, each rank's
worker asked for its own entering columns first), and the gradients of the entering columns,
which only their owners had, from them. FSDP2 (sharded.py): each rank scores its rows and the
scores are summed over the group; each rank migrates its rows like one process does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zfctl.offload.columns.departure import Departure, Pair
from zfctl.offload.columns.groups import Group
from zfctl.offload.columns.migration import Mover
from zfctl.offload.columns.selection import (
    HostRows,
    Moves,
    SelectionPlan,
    column_l1,
    migrate,
    plan_selection,
    stay_share,
    top_columns,
)
from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.cpu.host import HostState
from zfctl.offload.device.device_adam import DeviceAdam
from zfctl.offload.layout import DeviceBlock, Layout, as_matrix
from zfctl.offload.ledger import NOWHERE, Ledger
from zfctl.offload.parallel.exchange import GradExchange
from zfctl.offload.parallel.partition import OwnedRows, Partition
from zfctl.offload.parallel.sharded import ShardedParams
from zfctl.offload.sizing import out_elems, ring_elems, staging_cap
from zfctl.offload.stats import StepStats


class Selector:
    """The selection schedule and the selection step of one optimizer."""

    ledger: Ledger = NOWHERE  # where the migration's bytes and waits are counted (ledger.py)

    def __init__(self, layout: Layout, device: DeviceAdam, config: ZenFlowConfig, *,
                 steps_per_epoch: int | None, part: Partition | None = None,
                 exchange: GradExchange | None = None, sharded: ShardedParams | None = None) -> None:
        self.layout, self.device = layout, device
        self.part, self.exchange, self.sharded = part, exchange, sharded
        self.selectable = [s for s in layout.slots if s.selects]
        self.selected = not self.selectable  # nothing to choose: every device column is fixed
        self.warmup = config.full_warm_up_rounds if layout.host_slots else 0
        self.period = config.select_period(steps_per_epoch) if self.selectable else None
        self._pin = config.tuning.pin_memory
        self._out_cap = staging_cap(config.tuning.staging_mb)  # the out buffer's bytes, as the plan settled them
        self.mover: Mover | None = None  # the migration's streams and staging, made at the first selection
        self.departure: Departure | None = None  # the last selection's leaving state (migration.py)
        self.landing = Departure()  # a release step's leaving gradient columns, for ``land``
        self.moves: list[Moves] = []  # the last selection's moves, per selectable matrix
        self._arrival: tuple[Any, Any, Any] | None = None  # (pipeline, request, fill) until ``arrive``

    def _mover(self, pairs: int) -> Mover:
        """The migration's streams and page-locked buffers (migration.py ``Mover``): sized for a
        selection that replaces every device column (``pairs`` tensors per column: 3, or 4 with
        release.py's gradient), its out buffer capped by ``zenflow.tuning.staging_mb``; page-locked
        on CUDA with ``pin_memory``. The plan's "selection staging" line (sizing.py ``staging_bytes``)."""
        if self.mover is None:
            device = self.device.master.device
            elems = sum(s.k * s.rows for s in self.selectable)
            cols = sum(s.k for s in self.selectable)
            tallest = max(s.rows for s in self.selectable)
            self.mover = Mover(device, pin=self._pin and device.type == "cuda",
                               ring=ring_elems(elems, cols, tallest, pairs),
                               out=out_elems(elems, pairs, self._out_cap), ids=4 * cols)
            self.mover.ledger = self.ledger
        return self.mover

    def release(self) -> None:
        """Unpin the staging buffers (the optimizer's ``close()``, after the worker finished)."""
        if self.mover is not None:
            self.mover.release()

    def due(self, t: int) -> bool:
        """Selection happens at t == W and every select period after it."""
        if not self.selectable or t < self.warmup:
            return False
        return t == self.warmup or (self.period is not None and (t - self.warmup) % self.period == 0)

    def select(self, grads: list[torch.Tensor | None], host: HostState, stats: StepStats, *, pipeline: Any,
               scores: dict[int, torch.Tensor] | None = None,
               extra: Callable[[Moves, Departure], Pair | None] | None = None) -> list[torch.Tensor] | None:
        """Top-k columns per matrix from this step's gradient; state follows the columns.
        ``scores``: per param index, the column L1 a gradient hook took before it freed that
        ``.grad`` (release.py; the same ``column_l1``, so the same ranking). ``pipeline``: its
        worker updates the entering columns first and writes the leaving state (module
        docstring). ``extra``: more tensors to move per matrix (release.py ``regather_pairs``),
        their leaving rows written by ``land``.

        Data parallel: returns each matrix's total L1 mass (the auto interval's input: no rank
        holds the whole gradient), else None.
        """
        dev, index = self.device, self.device.index
        old = list(index)
        shared = None
        if self.exchange is not None:
            shared, sent = self.exchange.scores()
            stats.comm_bytes += sent
        elif self.sharded is not None:  # FSDP2: each rank scored its rows; the sum is the matrix's
            shared = self.sharded.column_scores(grads, self.selectable, dev.master.device)
        news = []
        for i, slot in enumerate(self.selectable):
            g = grads[slot.index]
            if shared is not None:
                score = shared[i]
            elif scores is not None and slot.index in scores:
                score = scores[slot.index]
            else:
                score = (column_l1(as_matrix(g, slot)) if g is not None
                         else torch.zeros(slot.cols, device=dev.master.device))
            news.append(top_columns(score, slot.k))
        mover = self._mover(3 + (extra is not None))
        self.landing = Departure(ledger=self.ledger, kind="host.migrate_land")
        # One D2H of every new column id and the old counters of the selectable blocks' device
        # columns (fp64: exact for both), one host wait: nothing can be planned before the ids exist.
        ks, blocks = [s.k for s in self.selectable], [b for b in self.layout.blocks if not b.fixed]
        fetched = mover.fetch(torch.cat([*news, *(dev.steps[b.col0 : b.col0 + b.ncols] for b in blocks)]).double())
        new_h = [c.long() for c in fetched[: sum(ks)].split(ks)]
        plan = plan_selection(self.layout, self.selectable, [dev.index_cpu[s.index] for s in self.selectable], new_h)
        self.moves = plan.moves
        # ZenFlow's premise, measured: how many device columns stay (None at the first selection).
        # Every rank chose from the same all-reduced scores (``shared``): one share for the group.
        stats.select_stay = stay_share(plan.moves)
        if self.part is None:
            # The update in flight updates the entering columns first, then runs the migration's
            # fill (their rows into the in ring); meanwhile this thread enqueues the leaving and
            # staying moves. ``arrive`` waits for the fill.
            req, fill = pipeline.request(plan.entering_runs), None
            try:
                fill, dep = self._migrate(host, plan, fetched[sum(ks) :].float(), extra)
            finally:
                pipeline.hand(req, fill)  # always: the worker waits for it once it has updated them
            pipeline.defer(dep.finish)  # worker thread, after the update in flight (pipeline.py settle)
            self._arrival = (pipeline, req, fill)
        else:  # data parallel: the owners' rows by collectives (partition.py), blocking
            pipeline.prioritize(plan.entering_runs)
            self._migrate_owned(host, stats, old, news)
        for slot, new, cols in zip(self.selectable, news, new_h):
            index[slot.index], dev.index_cpu[slot.index] = new, cols
        host.set_owned(plan.owned)
        self.selected = True
        if self.exchange is not None:
            self.exchange.replan()  # here, inside step(): not in the next backward's first hook
        if self.exchange is None or shared is None:
            return None
        stats.comm_bytes += self.exchange.share_entering(old)
        return [s.sum() for s in shared]

    def _migrate(self, host: HostState, plan: SelectionPlan, old_steps: torch.Tensor,
                 extra: Callable[[Moves, Departure], Pair | None] | None) -> tuple[Callable[[], int] | None, Departure]:
        """One process or an FSDP2 rank: asynchronous DMA, a group per state tensor and device
        block (migration.py); returns the fill and the leaving state's departure. The leaving counters are written here (the main
        thread owns ``steps``), from the counters fetched with the ids (``old_steps``: the
        selectable blocks' device columns, in order); the leaving master and moments by the
        worker, behind the update in flight, and with them the leaving columns' upload entries
        (``mirror``): the update in flight never wrote those (the device owned them), and its
        install, at the next boundary, DMAs them now that the host owns them: they must hold the
        master's rounding, which the params hold already."""
        assert self.mover is not None
        if self.departure is not None:
            self.departure.finish()  # the last selection's: written long ago (a boundary collected it)
        self.departure = dep = Departure(fence=_fence(host), ledger=self.ledger, kind="worker.migrate")
        d, groups, at = self.device, [], 0
        for b in plan.blocks:
            blk, ms = b.block, b.moves
            if any(b.leave_n):  # the leaving counters: a handful of ops per block, none per matrix
                base = torch.tensor([m.slot.host_col0 - m.slot.host_c0 for m in ms]).repeat_interleave(torch.tensor(b.leave_n))
                cols = torch.cat([m.leave_cols for m in ms]) + base
                host.steps.index_copy_(0, cols, old_steps[at : at + blk.ncols].index_select(0, b.leave_pos))
                self.ledger.moved("host.migrate", 4 * cols.numel())  # the leaving counters written
            at += blk.ncols
            hs = [host.column_state(m.slot) for m in ms]
            mirrors = [m.slot.host_view(host.upload) if host.upload is not None else None for m in ms]
            groups += [Group(_rows(d.master, blk), b, tuple(Pair(h.master, dep, mirror=u) for h, u in zip(hs, mirrors))),
                       Group(_rows(d.exp_avg, blk), b, tuple(Pair(h.exp_avg, dep) for h in hs)),
                       Group(_rows(d.exp_avg_sq, blk), b, tuple(Pair(h.exp_avg_sq, dep) for h in hs)),
                       Group(d.steps[blk.col0 : blk.col0 + blk.ncols].view(-1, 1), b,
                             tuple(Pair(h.steps.view(-1, 1), dep, leaves=False) for h in hs))]  # written above
            if extra is not None:
                pairs = tuple(extra(m, self.landing) for m in ms)
                if any(p is not None for p in pairs):
                    assert d.grad is not None
                    groups.append(Group(_rows(d.grad, blk), b, pairs))
        return self.mover.move(groups, first=self.landing), dep  # the gradient's pieces first: ``land`` waits for them

    def arrive(self) -> None:
        """After the caller re-planned the chunks: wait for the entering columns' update and the
        fill (pipeline.py ``wait_entering``: a host wait), then the compute stream waits for the
        migration (``Mover.join``: on the device) before the step's device AdamW. Nothing on a
        data-parallel selection (it migrated blocking) or when none happened."""
        if self._arrival is None:
            return
        (pipeline, req, fill), self._arrival = self._arrival, None
        pipeline.wait_entering(req, fill)
        assert self.mover is not None
        self.mover.join()

    def land(self) -> None:
        """After the step's device update is enqueued: a release step's leaving gradient columns
        into the step's slot (their D2H waited for: a host wait, selection steps of the release
        path only), before the interval is handed to the CPU worker. Nothing otherwise."""
        self.landing.finish()

    def _migrate_owned(self, host: HostState, stats: StepStats, old: list[torch.Tensor | None],
                       news: list[torch.Tensor]) -> None:
        """Data parallel: each owner's rows through ``OwnedRows`` (one all-reduce per state tensor)."""
        assert self.part is not None
        # OwnedRows writes the master and this writes the upload buffer now: the last install's DMA
        # must be done reading either (a host wait, data-parallel selection steps only).
        host.wait_install()
        for slot, new in zip(self.selectable, news):
            owned = [OwnedRows(h, slot.host_c0, slot.host_c1, self.part.group, self.device.master.device)
                     for h in host.column_state(slot)]
            rows: Sequence[HostRows] = tuple(owned)
            d2h, h2d = migrate(self.device.column_state(slot), rows, old[slot.index], new)
            self.ledger.moved("d2h.migrate", d2h)  # leaving columns' state
            self.ledger.moved("h2d.migrate", h2d)  # entering columns' state
            stats.comm_bytes += sum(o.sent for o in owned)
            was = old[slot.index]
            if host.upload is not None and was is not None:
                # This rank's leaving columns: the update in flight did not write their upload
                # entries (the device owned them), its install will DMA them (see ``_migrate``).
                gone = was.cpu()
                gone = gone[~torch.isin(gone, new.cpu()) & (gone >= slot.host_c0) & (gone < slot.host_c1)] - slot.host_c0
                up, master = slot.host_view(host.upload), slot.host_view(host.master)
                up.index_copy_(0, gone, master.index_select(0, gone).to(up.dtype))
                self.ledger.moved("host.migrate", (4 + up.element_size()) * gone.numel() * master.shape[1])

    def mass_totals(self, params: list[torch.Tensor], host_mass: torch.Tensor) -> list[torch.Tensor]:
        """Data parallel: each selectable matrix's total gradient L1 mass, the selected columns'
        (replicated) plus the owners' all-reduced host-path mass."""
        totals = []
        for i, slot in enumerate(self.selectable):
            g, idx = params[slot.index].grad, self.device.index[slot.index]
            assert g is not None and idx is not None  # the exchange filled .grad; masses follow a selection
            totals.append(column_l1(as_matrix(g, slot).index_select(1, idx)).sum() + host_mass[i])
        return totals

    def masses(self, grads: list[torch.Tensor | None], totals: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """The auto interval's inputs of one step: per selectable matrix, the selected columns' L1
        mass and the total (``totals``: when only the exchange knows them)."""
        out: list[torch.Tensor] = []
        zero = torch.zeros((), device=self.device.master.device)
        for i, slot in enumerate(self.selectable):
            g = grads[slot.index]
            if g is None:
                out += [zero, zero]
                continue
            l1 = column_l1(as_matrix(g, slot))
            out += [l1[self.device.index[slot.index]].sum(), l1.sum() if totals is None else totals[i]]
        return out

    def selected_fraction(self) -> float:
        """Share of matrix elements in device-owned columns."""
        mats = self.layout.matrices
        total = sum(s.rows * s.cols for s in mats)
        on_dev = sum(s.rows * s.k for s in mats if s.fixed or self.selected)
        return on_dev / total if total else 1.0

    def shapes(self) -> tuple[list[int], list[int]]:
        """(k, cols) per selectable matrix, for the auto interval's rule."""
        return [s.k for s in self.selectable], [s.cols for s in self.selectable]


def _rows(buf: torch.Tensor, block: DeviceBlock) -> torch.Tensor:
    """A device block's rows ``[ncols, length]`` of a flat device state buffer."""
    return buf[block.off : block.off + block.ncols * block.length].view(block.ncols, block.length)


def _fence(host: HostState) -> Any:
    """The last install's DMA (by value: ``HostState.install_fence`` stays for its other waiters)."""
    fence = host.install_fence
    return fence.synchronize if fence is not None else None
