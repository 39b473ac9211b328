"""Where the data-parallel exchange plans its rounds (docs/design.md, section "Data parallel"): with two batched copies,
on the main thread where the selection changes, never in the next backward's first gradient hook
(on CUDA a plan there was one stream sync per piece and per unit, several hundred at 7B).

No process group is needed: the partition is cut for rank 0 of 2 without one, and the
collectives are never reached."""

from __future__ import annotations

import torch
from test_distributed import _model

from zfctl.offload.columns.selector import Selector
from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.cpu.host import HostState
from zfctl.offload.device.device_adam import DeviceAdam
from zfctl.offload.grads.slots import GradSlots
from zfctl.offload.layout import plan_layout
from zfctl.offload.parallel import exchange as exchange_mod
from zfctl.offload.parallel.exchange import GradExchange
from zfctl.offload.parallel.partition import OwnedRows, partition_layout
from zfctl.offload.parallel.rounds import plan_rounds
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


class _Idle:
    """A pipeline with no CPU update in flight (pipeline.py ``prioritize``): nothing to wait for."""

    def prioritize(self, runs: torch.Tensor) -> float:
        return 0.0


def test_the_selection_plans_the_rounds_not_the_next_hook(monkeypatch) -> None:
    """A selection re-plans inside step() (``Selector.select``); afterwards ``rounds`` (what the
    hooks' ``launch`` reads) plans nothing."""
    local, part, params, dev = _setup()
    for p in params:
        p.grad = torch.randn_like(p)
    exchange = GradExchange(part, local, params, dev.index, torch.device("cpu"), norm=False, masses=False)
    host = HostState(local, params, grads=GradSlots(local.host_numel, torch.float32, per_set=1, sets=1, pin=False))
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
    monkeypatch.setattr("zfctl.offload.columns.selector.OwnedRows", _LocalRows)
    before = exchange.rounds
    # No update in flight: the pipeline's priority request has nothing to wait for (worker.py).
    selector.select([p.grad for p in params], host, StepStats(step=0), pipeline=_Idle())
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


class _Work:
    def wait(self) -> None:
        pass


def _pending_bytes(pending) -> int:
    """Bytes of the distinct buffers a launched exchange holds until it completes."""
    held = {}
    for _, t, _ in pending.replicated.items:
        held[t.data_ptr()] = t.numel() * t.element_size()
    for b in pending.replicated.buckets:
        held[b.flat.data_ptr()] = b.flat.numel() * b.flat.element_size()
    for rnd in pending.rounds:
        for t in (*rnd.send, rnd.out):
            held[t.data_ptr()] = t.numel() * t.element_size()
    return sum(held.values())


def test_an_exchange_in_flight_holds_what_the_plan_counts(monkeypatch) -> None:
    """A launched exchange holds its gathered send buffers and this rank's
    received share, at most twice the matrix (before the first selection every column is on the
    host path; a matrix one rank owns whole comes back whole). The plan's line is two of the
    largest: 4 w M."""
    from zfctl.offload.parallel import partition as partition_mod
    from zfctl.plan.memory import ModelSize, layout_counts

    monkeypatch.setattr(exchange_mod.dist, "reduce_scatter", lambda *a, **kw: _Work())
    monkeypatch.setattr(partition_mod.dist, "all_reduce", lambda *a, **kw: _Work())
    model = _model()
    named = list(model.named_parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    layout = plan_layout(named, 0.25)
    per_matrix: dict[int, int] = {}
    for rank in range(2):
        local, part = partition_layout(layout, None, rank, 2)
        params = [p for _, p in named]
        dev = DeviceAdam(local, params, torch.device("cpu"))
        ex = GradExchange(part, local, params, dev.index, torch.device("cpu"), norm=False, masses=False)
        for s in local.host_slots:
            got = _pending_bytes(ex.launch(s.index))
            bound = 2 * s.rows * s.cols * 4
            assert got <= bound, (s.name, got, bound)
            per_matrix[s.index] = max(per_matrix.get(s.index, 0), got)
    whole = [s for s in layout.host_slots if per_matrix[s.index] == 2 * s.rows * s.cols * 4]
    assert whole  # a matrix one rank owns whole: the bound is reached
    size = ModelSize(params=sum(p.numel() for _, p in named), params_2d=0,
                     shapes=[(n, tuple(p.shape)) for n, p in named])
    counts = layout_counts(size, 0.25, False)
    assert counts.largest == max(s.rows * s.cols for s in layout.host_slots)
    assert 4 * 4 * counts.largest >= sum(sorted(per_matrix.values())[-2:])  # two pending, fp32


def test_the_hooks_keep_at_most_two_exchanges_pending() -> None:
    """A hook that releases held-back matrices (the first in the exchange order got its gradient
    last) launches them one by one, completing the older ones as it goes: never more than two
    exchanges (and their buffers) pending, the plan's count."""
    from test_offload_helpers import tiny_net, zen

    from zfctl.offload import ZenFlowOptimizer
    from zfctl.offload.grads.stream import ExchangeOrder

    class Exchange:
        live = peak = 0

        def launch(self, index: int) -> int:
            self.live += 1
            self.peak = max(self.peak, self.live)
            return index

        def complete(self, pending: int) -> int:
            self.live -= 1
            return 0

    model = tiny_net()
    cfg = zen(topk_ratio=0.1, accumulate="host")
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2) as opt:
        stream = opt.gradient_path.stream
        order = [s.index for s in opt.layout.host_slots][::-1]
        assert len(order) >= 3
        stream._exchange, stream._order = Exchange(), ExchangeOrder(order)
        for p in opt.params:
            p.grad = torch.randn_like(p)
        opt.prepare_backward(final=True)
        for index in [*order[1:], order[0]]:  # the first in the order comes last: all held back
            stream.on_grad(index, opt.params[index])
        assert stream._exchange.peak == 2 and len(stream._launched) == 1
        stream.complete_exchanges()
        stream.disarm()


def test_the_plan_counts_the_exchange_only_under_data_parallel() -> None:
    """zfctl plan: 'gradient exchange in flight' = 4 w M with distributed.nproc > 1 (M: the largest
    matrix with host columns, bf16 here), no line for one process."""
    from zfctl.plan import resolve_plan
    from zfctl.plan.memory import GB, Machine, estimate, model_size

    machine = Machine(512 * GB, True, "GPU", 80 * GB)
    one = estimate(resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.precision=bf16"]), machine)
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.precision=bf16", "distributed.nproc=2"])
    two = estimate(plan, machine)
    size = model_size(plan)
    assert size is not None and size.shapes
    largest = max(s[0] * s[1] for _, s in size.shapes if len(s) == 2)
    assert one.item("gradient exchange in flight") == 0
    assert two.item("gradient exchange in flight") == 4 * 2 * largest
