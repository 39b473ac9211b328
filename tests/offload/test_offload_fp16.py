"""fp16: the optimizer owns a dynamic loss scaler; an overflow skips the step on BOTH paths."""

from __future__ import annotations

import math

import pytest
import torch
from test_offload_helpers import batches, max_rel_err, snapshot, tiny_net, zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.grads.scaler import DynamicLossScaler


def fp16_step(model, opt, x, y, poison: bool = False):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    opt.scale_loss(loss).backward()
    if poison:
        model.fc2.weight.grad[5, 7] = math.inf  # one element of a host-owned or device column
    return opt.step()


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_injected_inf_skips_both_paths_and_lowers_the_scale(overlap: bool) -> None:
    model = tiny_net(dtype=torch.float16)
    cfg = zen(topk_ratio=0.1, update_interval=4, overlap_step=overlap)
    data = batches(8, dtype=torch.float16)
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-3, max_grad_norm=1.0) as opt:
        assert opt.scale_loss(torch.tensor(2.0)).item() == 2.0 * 2**16
        for x, y in data[:5]:  # step 4: one step into the second interval, overlap has one in flight
            assert not fp16_step(model, opt, x, y).skipped
        params = snapshot(model)
        # The slot set the main thread fills: with overlap the in-flight CPU update owns the other
        # one until the next boundary (zfctl/offload/cpu/host.py's table).
        cur = opt.pipeline.cur
        recorded = list(opt.host.grads.coefs[cur])
        dev = opt.device_state.master.clone(), opt.device_state.exp_avg_sq.clone(), opt.device_state.steps.clone()
        host_steps = opt.host.steps.clone()

        stats = fp16_step(model, opt, *data[5], poison=True)
        assert stats.skipped and stats.step == 5 and not stats.boundary
        assert stats.loss_scale == 2**16 and opt.scaler.scale == 2**15
        after = snapshot(model)
        assert all(torch.equal(params[n], after[n]) for n in params)  # device path: nothing moved
        assert opt.host.grads.coefs[cur] == recorded  # host path: no slot recorded
        assert torch.equal(dev[0], opt.device_state.master) and torch.equal(dev[1], opt.device_state.exp_avg_sq)
        assert torch.equal(dev[2], opt.device_state.steps) and torch.equal(host_steps, opt.host.steps)

        stats = fp16_step(model, opt, *data[6])  # the same step index, taken for real
        assert not stats.skipped and stats.step == 5 and stats.loss_scale == 2**15
        assert not any(torch.equal(params[n], p) for n, p in snapshot(model).items())


def test_unscale_is_folded_into_the_coefficient() -> None:
    # eps = 1e-3 makes AdamW sensitive to the gradient's scale: a missing unscale would show.
    def run(loss_scaling: bool):
        model = tiny_net(dtype=torch.float16)
        cfg = zen(topk_ratio=0.1, update_interval=2, overlap_step=False)
        with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2, eps=1e-3, loss_scaling=loss_scaling) as opt:
            for x, y in batches(6, dtype=torch.float16):
                assert not fp16_step(model, opt, x, y).skipped
        return snapshot(model)

    start = snapshot(tiny_net(dtype=torch.float16))
    scaled, plain = run(True), run(False)
    assert max_rel_err(scaled, start) > 1e-2
    assert max_rel_err(scaled, plain) < 2e-3  # fp16 rounding of the weights only


def test_scaler_grows_after_good_steps_and_backs_off() -> None:
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 16.0
    s.update(overflow=True)
    assert s.scale == 8.0 and s.good_steps == 0
