"""Where the data-parallel exchange plans its rounds (issue 28, item 4): with two batched copies,
on the main thread where the selection changes, never in the next backward's first gradient hook
(on CUDA a plan there was one stream sync per piece and per unit, several hundred at 7B).

No process group is needed: the partition is cut for rank 0 of 2 without one, and the
collectives are never reached."""

from __future__ import annotations

import torch
from test_distributed import _model

from zfctl.offload import exchange as exchange_mod
from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.device_adam import DeviceAdam
from zfctl.offload.exchange import GradExchange, plan_rounds
from zfctl.offload.host import HostState
from zfctl.offload.layout import plan_layout
from zfctl.offload.partition import OwnedRows, partition_layout
from zfctl.offload.selector import Selector
from zfctl.offload.stats import StepStats


def _setup():
    model = _model()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    local, part = partition_layout(plan_layout(named, 0.25), None, 0, 2)
    dev = DeviceAdam(local, params, torch.device("cpu"))
    return local, part, params, dev


def test_a_plan_copies_the_ids_once_each_way(monkeypatch) -> None:
    """One D2H of every selected id list and one H2D of every unit's ids, however many pieces
    and units (counted as ``Tensor.to`` calls: on CPU the H2D is not even a copy)."""
    local, part, _, _ = _setup()
    index = [torch.arange(0, s.cols, 3) if s.selects else None for s in local.slots]
    calls: list[str] = []
    to = torch.Tensor.to

    def counted(self, *args, **kw):
        calls.append(str(args[0]) if args else str(kw))
        return to(self, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "to", counted)
    rounds = plan_rounds(part, local, index, 4, torch.device("cpu"))
    units = sum(len(owner) for rnd in rounds for owner in rnd)
    assert units > 3 and sum(index[s.index] is not None for s in local.slots) >= 2
    assert calls == ["cpu"], calls


def test_the_selection_plans_the_rounds_not_the_next_hook(monkeypatch) -> None:
    """A selection re-plans inside step() (``Selector.select``); afterwards ``rounds`` (what the
    hooks' ``launch`` reads) plans nothing."""
    local, part, params, dev = _setup()
    for p in params:
        p.grad = torch.randn_like(p)
    exchange = GradExchange(part, local, params, dev.index, torch.device("cpu"), norm=False, masses=False)
    host = HostState(local, params, accumulators=1)
    selector = Selector(local, dev, ZenFlowConfig(), steps_per_epoch=10, part=part, exchange=exchange)
    plans: list[int] = []
    real = exchange_mod.plan_rounds

    def spy(*args, **kw):
        plans.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(exchange_mod, "plan_rounds", spy)
    # The collectives of a selection, stood in for: the scores (every owner's L1, as one rank
    # would see them all-reduced) and the entering columns' gradients.
    monkeypatch.setattr(exchange, "scores", lambda: ([torch.rand(s.cols) for s in selector.selectable], 0))
    monkeypatch.setattr(exchange, "share_entering", lambda old: 0)
    monkeypatch.setattr("zfctl.offload.selector.OwnedRows", _LocalRows)
    before = exchange.rounds
    selector.select([p.grad for p in params], host, StepStats(step=0))
    assert plans == [1]  # planned once, in select()
    after = exchange.rounds  # the next backward's first hook: nothing left to plan
    assert plans == [1] and after is not before
    selected = {(u.slot.index, int(c)) for rnd in after for owner in rnd for u in owner for c in u.ids}
    for s in selector.selectable:
        assert not any((s.index, int(c)) in selected for c in dev.index[s.index])


class _LocalRows(OwnedRows):
    """partition.OwnedRows without its all-reduce: rank 0's own rows, zeros for the other
    owner's (the migration's values are not what this test checks)."""

    def index_select(self, dim: int, cols: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((len(cols), *self.rows.shape[1:]), dtype=self.rows.dtype)
        mine = self._mine(cols)
        out[mine] = self.rows.index_select(0, cols[mine] - self.c0)
        return out
