"""The optimizer as a library: construction rules, errors that name the fix, lifecycle, stats."""

from __future__ import annotations

import pytest
import torch
from test_offload_helpers import tiny_net, train, zen

from zfctl.errors import ConfigError, UserError
from zfctl.offload import StepStats, ZenFlowConfig, ZenFlowOptimizer
from zfctl.offload.config import TuningConfig


def test_parameter_forms_and_rejections() -> None:
    model = tiny_net()
    params = list(model.parameters())
    with ZenFlowOptimizer(params) as opt:  # bare tensors get positional names; the default config
        assert opt.names[:2] == ["param0", "param1"]
    with pytest.raises(TypeError, match="one parameter group"):
        ZenFlowOptimizer([{"params": params}], ZenFlowConfig())
    with pytest.raises(ValueError, match="given twice"):
        ZenFlowOptimizer([params[0], params[0]], ZenFlowConfig())
    model.fc1.weight.requires_grad_(False)  # frozen: left out, never touched
    with ZenFlowOptimizer(model.named_parameters(), ZenFlowConfig()) as opt:
        assert "fc1.weight" not in opt.names
        with pytest.raises(NotImplementedError):
            opt.add_param_group({"params": [model.fc1.weight]})


def test_config_errors_name_the_key() -> None:
    params = list(tiny_net().named_parameters())
    with pytest.raises(ConfigError, match=r"zenflow\.topk_ratio"):
        ZenFlowOptimizer(params, ZenFlowConfig(topk_ratio=1.5))
    with pytest.raises(ConfigError, match=r"zenflow\.tuning\.ring_slot_mb=0\.0001: one column of 'fc1.weight'"):
        ZenFlowOptimizer(params, ZenFlowConfig(tuning=TuningConfig(ring_slot_mb=0.0001)))  # a 48-row fp32 column is 192 B
    with pytest.raises(UserError, match="zenflow.select_interval=epoch needs the epoch length: pass steps_per_epoch"):
        ZenFlowOptimizer(params, ZenFlowConfig(select_interval="epoch"))
    with pytest.raises(UserError, match="steps_per_epoch"):
        ZenFlowOptimizer(params, ZenFlowConfig(select_interval="2 epochs"))


def test_select_period_from_the_epoch_length() -> None:
    model = tiny_net()
    cfg = zen(topk_ratio=0.1, update_interval=4, overlap_step=False)
    with ZenFlowOptimizer(model.named_parameters(), cfg, steps_per_epoch=6) as opt:
        stats = train(model, opt, 14)
    assert [s.step for s in stats if s.selection] == [0, 6, 12]
    # The step before each re-selection ends an interval early (5, 11), so no interval spans one.
    assert [s.step for s in stats if s.boundary] == [3, 5, 9, 11]
    assert [s.update_interval for s in stats if s.boundary] == [4, 2, 4, 2]


def test_select_period_in_steps_counts_from_the_end_of_warm_up() -> None:
    # The default's refresh (select_interval 8 steps): every 8 steps after W=2 warm-up steps,
    # with U=4 intervals that line up with it, so no interval is cut short.
    model = tiny_net()
    cfg = zen(topk_ratio=0.25, update_interval=4, select_interval=8, full_warm_up_rounds=2)
    with ZenFlowOptimizer(model.named_parameters(), cfg) as opt:
        stats = train(model, opt, 20)
    assert [s.step for s in stats if s.selection] == [2, 10, 18]
    assert [s.step for s in stats if s.boundary] == [0, 1, 5, 9, 13, 17]
    assert {s.update_interval for s in stats if s.boundary and not s.warmup} == {4}


def test_lifecycle_close_flush_and_closure() -> None:
    model = tiny_net()
    opt = ZenFlowOptimizer(model.named_parameters(), zen(topk_ratio=0.1, update_interval=2))
    x = torch.randn(4, 16)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    for _ in range(4):  # boundaries at 1 and 3: with overlap the second update is still pending
        stats = opt.step(closure)
    assert isinstance(stats, StepStats) and opt.last_stats is stats and opt.pipeline.busy
    before = model.fc2.weight.detach().clone()
    opt.flush()  # installs it now
    assert not opt.pipeline.busy and not torch.equal(before, model.fc2.weight)
    opt.close()
    opt.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        opt.step(closure)


def test_stats_describe_the_step() -> None:
    model = tiny_net()
    cfg = zen(topk_ratio=0.1, update_interval=4)
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=1.0) as opt:
        stats = train(model, opt, 8)
        assert opt.scale_loss(torch.tensor(3.0)).item() == 3.0  # fp32: no loss scaling
    mats = [p for p in model.parameters() if p.dim() == 2]
    k_elems = 48 * 1 + 48 * 4 + 8 * 4  # fc1 (16 cols -> 1), fc2 (48 -> 4), head (48 -> 4)
    assert stats[0].selection and stats[0].selected_fraction == k_elems / sum(p.numel() for p in mats)
    assert all(s.loss_scale is None and s.grad_norm > 0 and s.update_interval == 4 for s in stats)
    assert [s.cpu_step_ms > 0 for s in stats] == [False] * 7 + [True]  # update 0 completes at step 7
    assert stats[7].installed and stats[7].h2d_bytes == sum(p.numel() * 4 for p in mats)
