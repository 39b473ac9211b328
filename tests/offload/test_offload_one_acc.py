"""One gradient slot set with overlap_step (``host_accumulators: 1``, zfctl/offload/grads/acc_gate.py):
the same bits as two.

The CPU update reads the interval's slots while the next interval's steps overwrite them, piece
by piece behind the update's watermark. Nothing may change but the waits: parameters and losses
are compared with ``torch.equal`` against the two-set run, on both gradient paths, and a worker
slowed down between pieces makes a missing wait show up as wrong bits.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_offload_helpers import batches, tiny_net, zen

from zfctl.errors import ConfigError
from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.config import TuningConfig, ZenFlowConfig
from zfctl.offload.cpu.host import slot_sets
from zfctl.plan import resolve_plan
from zfctl.train.models.load import load_model
from zfctl.train.optim import build_optimizer

STEPS = 30


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def llama_run(accumulators: int, hooks: bool, interval: int, lag: int) -> tuple[list[torch.Tensor], list[float]]:
    """30 steps of tiny-llama, fp32 on CPU, overlap on, clipping at the plan's max_grad_norm;
    ``hooks``: the loop announces each final backward (the hook path), else step() lands."""
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        "train.device=cpu", "train.precision=fp32", "zenflow.overlap_step=true", "zenflow.full_warm_up_rounds=2",
        f"zenflow.update_interval={interval}", "zenflow.select_interval=8", f"zenflow.tuning.install_lag={lag}",
        f"zenflow.tuning.host_accumulators={accumulators}"])
    model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=0)
    gen = torch.Generator().manual_seed(0)
    losses = []
    with build_optimizer(model, plan, steps_per_epoch=100) as opt:
        assert opt.host is not None and opt.host.grads.sets == accumulators
        for _ in range(STEPS):
            ids = torch.randint(0, 4096, (2, 32), generator=gen)
            opt.zero_grad(set_to_none=True)
            if hooks:
                opt.prepare_backward(final=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        opt.flush()
    return [p.detach().clone() for p in model.parameters()], losses


@pytest.mark.parametrize("lag", [0, 1], ids=["lag0", "lag1"])
@pytest.mark.parametrize("interval", [2, 4], ids=["U2", "U4"])
@pytest.mark.parametrize("hooks", [False, True], ids=["step-path", "hook-path"])
def test_one_accumulator_is_bit_identical_to_two_on_tiny_llama(hooks: bool, interval: int, lag: int) -> None:
    two, one = llama_run(2, hooks, interval, lag), llama_run(1, hooks, interval, lag)
    assert one[1] == two[1]
    assert all(torch.equal(a, b) for a, b in zip(one[0], two[0]))
    assert one[1][0] != one[1][-1]  # it trained


def tiny_run(accumulators: int, hooks: bool, clip: float | None, interval: int, *, pause: float = 0.0,
             steps: int = STEPS):
    """``pause``: seconds the CPU worker sleeps before each piece (a slow update)."""
    model = tiny_net()
    cfg = zen(topk_ratio=0.25, update_interval=interval, overlap_step=True,
              host_accumulators=accumulators)
    losses, waits = [], 0
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2, max_grad_norm=clip) as opt:
        assert opt.pipeline.worker is not None and opt.host is not None and opt.host.grads.sets == accumulators
        if pause:
            opt.pipeline.worker.before_piece = lambda i: time.sleep(pause)
        for x, y in batches(steps):
            opt.zero_grad(set_to_none=True)
            if hooks:
                opt.prepare_backward(final=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            waits += opt.step().acc_gate_waits
            losses.append(loss.item())
        opt.flush()
    return [p.detach().clone() for p in model.parameters()], losses, waits


@pytest.mark.parametrize("interval", [1, 2], ids=["U1", "U2"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["coef-known", "clipped"])
@pytest.mark.parametrize("hooks", [False, True], ids=["step-path", "hook-path"])
def test_a_slow_cpu_update_is_waited_for_not_overtaken(hooks: bool, clip: float | None, interval: int) -> None:
    """The worker sleeps 5 ms before each of its three pieces, so the next interval's first step
    reaches the slots long before the update has read them: without the wait it overwrites the
    slot being read (different bits); with it, it waits (counted) and the bits are the same."""
    ref = tiny_run(2, hooks, clip, interval)
    got = tiny_run(1, hooks, clip, interval, pause=0.005)
    assert ref[2] == 0  # two accumulators: nothing ever waits
    assert got[2] > 0  # the slow update was caught up with, and waited for
    assert got[1] == ref[1]
    assert all(torch.equal(a, b) for a, b in zip(got[0], ref[0]))


def test_the_count_is_one_wherever_nothing_lands_on_the_host_meanwhile() -> None:
    common = {"committed_bytes": 16, "set_bytes": 4}
    assert slot_sets(2, overlap=False, summed_on_host=True, **common) == 1  # the step waits anyway
    assert slot_sets(2, overlap=True, summed_on_host=False, **common) == 1  # the device path
    assert slot_sets(1, overlap=True, summed_on_host=True, **common) == 1
    assert slot_sets(2, overlap=True, summed_on_host=True, **common) == 2
    assert slot_sets("auto", overlap=True, summed_on_host=True, **common) == 2  # 20 B fit
    assert slot_sets("auto", overlap=True, summed_on_host=True, committed_bytes=2**62, set_bytes=4) == 1


def test_host_accumulators_is_validated() -> None:
    for bad in (0, 3, "two", 1.5, True):
        with pytest.raises(ConfigError, match="zenflow.tuning.host_accumulators"):
            ZenFlowConfig(tuning=TuningConfig(host_accumulators=bad)).validate()
