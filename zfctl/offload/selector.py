"""When the device's columns are chosen, and choosing them: the selection schedule and its step.

Selection happens at step ``t == W`` (the end of the full warm-up) and then every select period
(``zenflow.select_interval``: steps, or epochs of ``steps_per_epoch``; ``ZenFlowConfig.select_period``). Each matrix keeps its top ``k`` columns scored by
the L1 norm of that step's raw gradient (the coefficient is one positive factor and does not
change the ranking), and the state of entering and leaving columns migrates between the host and
the device (selection.py ``migrate``). The caller drains the CPU pipeline first, so selection
never races the worker, and re-plans the column chunks after it (device-owned columns changed).

Data parallel: the scores come from every owner (one all-reduce, exchange.py), the state of an
entering column from its owner (partition.py ``OwnedRows``), and the gradients of the entering
columns, which only their owners had, from them. FSDP2 (sharded.py): each rank scores its rows
and the scores are summed over the group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.device_adam import DeviceAdam
from zfctl.offload.exchange import GradExchange
from zfctl.offload.host import HostState
from zfctl.offload.layout import Layout, as_matrix
from zfctl.offload.ledger import NOWHERE, Ledger
from zfctl.offload.partition import OwnedRows, Partition
from zfctl.offload.selection import HostRows, Staging, column_l1, migrate, top_columns
from zfctl.offload.sharded import ShardedParams
from zfctl.offload.sizing import STAGE_BYTES
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
        self.stage: Staging | None = None  # the migration's host staging, made at the first selection

    def _staging(self) -> Staging:
        """The migration's reused host buffer (selection.py ``Staging``): ``STAGE_BYTES`` or the
        largest matrix, whichever is smaller, at least one column of the tallest matrix;
        page-locked on CUDA with ``pin_memory``."""
        if self.stage is None:
            device = self.device.master.device
            # No larger than the largest matrix (a migration never moves more of one state
            # tensor at once), no smaller than one column: the plan's "selection staging" line.
            largest = max(s.rows * s.cols for s in self.selectable)
            elems = max(min(STAGE_BYTES // 4, largest), max(s.rows for s in self.selectable))
            self.stage = Staging(elems, pin=self._pin and device.type == "cuda", device=device)
            self.stage.ledger = self.ledger
        return self.stage

    def release(self) -> None:
        """Unpin the staging buffer (the optimizer's ``close()``)."""
        if self.stage is not None:
            self.stage.release()

    def due(self, t: int) -> bool:
        """Selection happens at t == W and every select period after it."""
        if not self.selectable or t < self.warmup:
            return False
        return t == self.warmup or (self.period is not None and (t - self.warmup) % self.period == 0)

    def select(self, grads: list[torch.Tensor | None], host: HostState, stats: StepStats,
               scores: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """Top-k columns per matrix from this step's gradient; state follows the columns.
        ``scores``: per param index, the column L1 a gradient hook took before it freed that
        ``.grad`` (release.py; the same ``column_l1``, so the same ranking).

        Data parallel: returns each matrix's total L1 mass (the auto interval's input: no rank
        holds the whole gradient), else None.
        """
        host.wait_master()  # migration writes the master: an fp32 model's install DMA must be done
        dev, index = self.device, self.device.index
        old = list(index)
        shared = None
        if self.exchange is not None:
            shared, sent = self.exchange.scores()
            stats.comm_bytes += sent
        elif self.sharded is not None:  # FSDP2: each rank scored its rows; the sum is the matrix's
            shared = self.sharded.column_scores(grads, self.selectable, dev.master.device)
        for i, slot in enumerate(self.selectable):
            g = grads[slot.index]
            if shared is not None:
                score = shared[i]
            elif scores is not None and slot.index in scores:
                score = scores[slot.index]
            else:
                score = (column_l1(as_matrix(g, slot)) if g is not None
                         else torch.zeros(slot.cols, device=dev.master.device))
            new = top_columns(score, slot.k)
            own = host.column_state(slot)
            rows: Sequence[HostRows] = own
            owned: list[OwnedRows] = []
            stage = self._staging() if self.part is None else None  # owners' rows come by collectives
            if self.part is not None:  # this rank holds only some rows: owners supply the rest
                owned = [OwnedRows(h, slot.host_c0, slot.host_c1, self.part.group, dev.master.device) for h in own]
                rows = tuple(owned)
            d2h, h2d = migrate(dev.column_state(slot), rows, index[slot.index], new, stage)
            self.ledger.moved("d2h.migrate", d2h)  # leaving columns' state
            self.ledger.moved("h2d.migrate", h2d)  # entering columns' state
            stats.comm_bytes += sum(o.sent for o in owned)
            index[slot.index] = new
            host.set_device_owned(slot, new)
        self.selected = True
        if self.exchange is not None:
            self.exchange.replan()  # here, inside step(): not in the next backward's first hook
        if self.exchange is None or shared is None:
            return None
        stats.comm_bytes += self.exchange.share_entering(old)
        return [s.sum() for s in shared]

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
