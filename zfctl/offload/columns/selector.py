"""When the device's columns are chosen, and choosing them: the selection schedule and its step.

Selection happens at step ``t == W`` (the end of the full warm-up) and then every select period
(``zenflow.select_interval``: steps, or epochs of ``steps_per_epoch``; ``ZenFlowConfig.select_period``).
Each matrix keeps its top ``k`` columns scored by the L1 norm of that step's raw gradient (the
coefficient is one positive factor and does not change the ranking), and the state of entering
and leaving columns migrates between the host and the device.

The step does not drain the CPU pipeline. The update submitted at the boundary one step earlier
may still run: it owns the host rows of the columns that were host-owned when it was submitted,
and never touches the rows of the device-owned ones. So the selection (1) brings the new column
ids to the host (one D2H, one host wait), (2) asks the worker to update the entering columns
first (``prioritize``: a host wait for that part only) and (3) migrates: the leaving columns'
rows were device-owned during that update, so their host rows can be written while it runs; the
entering ones are read once the worker has updated them and left them out of the rest
(migration.py: asynchronous DMA, the leaving rows written by the worker behind the update). The
rest of the update installs on the ordinary schedule (pipeline.py). The caller re-plans the
column chunks after it (device-owned columns changed).

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
from zfctl.offload.columns.migration import Mover
from zfctl.offload.columns.selection import (
    HostRows,
    Moves,
    column_l1,
    migrate,
    plan_moves,
    stay_share,
    top_columns,
)
from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.cpu.host import HostState
from zfctl.offload.device.device_adam import DeviceAdam
from zfctl.offload.layout import Layout, as_matrix, column_runs
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
               extra: Callable[[Moves, Departure], list[Pair]] | None = None) -> list[torch.Tensor] | None:
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
        # One D2H of every new column id and the old device counters (fp64: exact for both), one
        # host wait: nothing can be planned before the ids exist.
        ks = [s.k for s in self.selectable]
        fetched = mover.fetch(torch.cat([*news, *(dev.column_state(s).steps for s in self.selectable)]).double())
        new_h = [c.long() for c in fetched[: sum(ks)].split(ks)]
        old_steps = [c.float() for c in fetched[sum(ks) :].split(ks)]
        self.moves = [plan_moves(s, dev.index_cpu[s.index], n) for s, n in zip(self.selectable, new_h)]
        # ZenFlow's premise, measured: how many device columns stay (None at the first selection).
        # Every rank chose from the same all-reduced scores (``shared``): one share for the group.
        stats.select_stay = stay_share([dev.index_cpu[s.index] for s in self.selectable], new_h,
                                       [s.cols for s in self.selectable])
        # The update in flight updates the entering columns first: a host wait for that part only.
        pipeline.prioritize(self._entering_runs(host))
        if self.part is None:
            self._migrate(host, pipeline, old_steps, extra)
        else:  # data parallel: the owners' rows by collectives (partition.py), blocking
            self._migrate_owned(host, stats, old, news)
        for slot, new, cols in zip(self.selectable, news, new_h):
            index[slot.index], dev.index_cpu[slot.index] = new, cols
            host.set_device_owned(slot, cols)
        self.selected = True
        if self.exchange is not None:
            self.exchange.replan()  # here, inside step(): not in the next backward's first hook
        if self.exchange is None or shared is None:
            return None
        stats.comm_bytes += self.exchange.share_entering(old)
        return [s.sum() for s in shared]

    def _entering_runs(self, host: HostState) -> torch.Tensor:
        """The flat host elements of every entering column this rank holds (a run list)."""
        mask = torch.zeros(host.layout.host_cols, dtype=torch.bool)
        for m in self.moves:
            s = m.slot
            c = m.enter_cols[(m.enter_cols >= s.host_c0) & (m.enter_cols < s.host_c1)]
            mask[s.host_col0 + c - s.host_c0] = True
        return column_runs(mask, host.layout.host_col_offsets)

    def _migrate(self, host: HostState, pipeline: Any, old_steps: list[torch.Tensor],
                 extra: Callable[[Moves, Departure], list[Pair]] | None) -> None:
        """One process or an FSDP2 rank: asynchronous DMA (migration.py). The leaving counters are
        written here (the main thread owns ``steps``), from the counters fetched with the ids; the
        leaving master and moments by the worker, behind the update in flight, and with them the
        leaving columns' upload entries (``mirror``): the update in flight never wrote those (the
        device owned them), and its install, at the next boundary, DMAs them now that the host
        owns them: they must hold the master's rounding, which the params hold already."""
        assert self.mover is not None
        if self.departure is not None:
            self.departure.finish()  # the last selection's: written long ago (a boundary collected it)
        self.departure = dep = Departure(fence=_fence(host), ledger=self.ledger, kind="worker.migrate")
        jobs = []
        for m, steps in zip(self.moves, old_steps):
            d, h = self.device.column_state(m.slot), host.column_state(m.slot)
            h.steps.index_copy_(0, m.leave_cols, steps.index_select(0, m.leave_pos))
            self.ledger.moved("host.migrate", 4 * m.leave_cols.numel())  # the leaving counters written
            mirror = m.slot.host_view(host.upload) if host.upload is not None else None
            pairs = [Pair(d.master, h.master, dep, mirror=mirror), Pair(d.exp_avg, h.exp_avg, dep),
                     Pair(d.exp_avg_sq, h.exp_avg_sq, dep),
                     Pair(d.steps.view(-1, 1), h.steps.view(-1, 1), dep, leaves=False)]  # written above
            jobs.append((m, pairs + (extra(m, self.landing) if extra is not None else [])))
        self.mover.move(jobs, first=self.landing)  # the gradient's pieces first: ``land`` waits for them
        pipeline.defer(dep.finish)  # worker thread, after the update in flight (pipeline.py settle)

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


def _fence(host: HostState) -> Any:
    """The last install's DMA (by value: ``HostState.install_fence`` stays for its other waiters)."""
    fence = host.install_fence
    return fence.synchronize if fence is not None else None
