"""The two limits of ZenFlow are plain AdamW: everything on the device (topk_ratio 1) and everything on
the CPU, updated every step, without overlap (topk_ratio 0, update_interval 1: ZeRO-Offload)."""

from __future__ import annotations

import pytest
import torch
from test_offload_helpers import max_rel_err, snapshot, tiny_net, train, zen

from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer
from zfctl.offload.layout import plan_layout

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
STEPS = 50

ALL_DEVICE = zen(topk_ratio=1.0)
ZERO_OFFLOAD = zen(topk_ratio=0.0, update_interval=1, overlap_step=False)


def reference(steps: int = STEPS, clip: float | None = None, schedule: bool = False) -> dict[str, torch.Tensor]:
    model = tiny_net()
    opt = torch.optim.AdamW(model.parameters(), **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
    train(model, opt, steps, clip=clip, scheduler=sched)
    return snapshot(model)


def zenflow(cfg: ZenFlowConfig, steps: int = STEPS, clip: float | None = None, schedule: bool = False):
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
        stats = train(model, opt, steps, scheduler=sched)
        opt.flush()
    return snapshot(model), stats


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [ALL_DEVICE, ZERO_OFFLOAD], ids=["r=1", "r=0,U=1"])
@pytest.mark.parametrize("clip", [None, 0.25], ids=["noclip", "clip"])
def test_limits_reproduce_torch_adamw(cfg: ZenFlowConfig, clip: float | None) -> None:
    """topk_ratio 1 (no host columns) and plain ZeRO-Offload (intervals of one step, where the
    interval-mean clip factor is the step's own) are torch's AdamW, clipping included."""
    ref = reference(clip=clip)
    got, stats = zenflow(cfg, clip=clip)
    assert max_rel_err(got, ref) <= 1e-5
    moved = max_rel_err(ref, snapshot(tiny_net()))
    assert moved > 1e-2  # the comparison is meaningful: 50 steps moved the weights a lot
    if clip is not None:  # clipping was active, and the norm reported is the pre-clip norm
        assert sum(s.grad_norm > clip for s in stats) >= STEPS // 2


def test_zero_offload_moves_every_matrix_through_the_cpu() -> None:
    _, stats = zenflow(ZERO_OFFLOAD, steps=3)
    model = tiny_net()
    matrix_bytes = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2)
    for s in stats:
        assert s.boundary and s.installed and s.selected_fraction == 0.0
        assert s.d2h_bytes == matrix_bytes + 8  # every gradient column + the norm and clip factor scalars
        assert s.h2d_bytes == matrix_bytes  # every updated column back
    _, stats = zenflow(ALL_DEVICE, steps=2)
    assert all(s.d2h_bytes == 0 and s.h2d_bytes == 0 and s.selected_fraction == 1.0 for s in stats)


@pytest.mark.slow
def test_lr_scheduler_drives_both_paths() -> None:
    ref = reference(schedule=True)
    for cfg in (ALL_DEVICE, ZERO_OFFLOAD):
        got, _ = zenflow(cfg, schedule=True)
        assert max_rel_err(got, ref) <= 1e-5


@pytest.mark.slow
def test_warm_up_steps_are_full_offload_steps() -> None:
    # While step < full_warm_up_rounds every matrix goes through the CPU AdamW synchronously, so a
    # run that never leaves warm-up is AdamW whatever topk_ratio/update_interval/overlap say.
    cfg = zen(topk_ratio=0.1, update_interval=4, overlap_step=True, full_warm_up_rounds=STEPS)
    got, stats = zenflow(cfg)
    assert all(s.warmup and s.boundary and s.installed and not s.selection for s in stats)
    assert max_rel_err(got, reference()) <= 1e-5


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3)  # weight [6, 3, 3, 3] -> matrix [6, 27]
        self.fc = torch.nn.Linear(6 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def test_higher_rank_weights_are_matrices_over_flattened_trailing_dims() -> None:
    named = list(ConvNet().named_parameters())
    conv = plan_layout(named, 0.2).slots[0]
    assert (conv.rows, conv.cols, conv.k, conv.dense) == (6, 27, 5, False)

    def run(opt_factory, steps: int = 12):
        torch.manual_seed(0)
        net = ConvNet()
        opt = opt_factory(net)
        g = torch.Generator().manual_seed(3)
        before = net.conv.weight.detach().clone()
        for _ in range(steps):
            opt.zero_grad()
            net(torch.randn(4, 3, 6, 6, generator=g)).square().mean().backward()
            opt.step()
        if hasattr(opt, "close"):
            opt.close()
        return before, snapshot(net)

    _, ref = run(lambda n: torch.optim.AdamW(n.parameters(), **HP))
    _, got = run(lambda n: ZenFlowOptimizer(n.named_parameters(), ZERO_OFFLOAD, **HP))
    assert max_rel_err(got, ref) <= 1e-5
    # With selection, the conv weight's device columns are whole (in, kh, kw) positions: before
    # the first boundary (step 7) exactly those 5 columns of the [6, 27] view have changed.
    cfg = zen(topk_ratio=0.2, update_interval=8, overlap_step=False, select_interval=64)
    before, after = run(lambda n: ZenFlowOptimizer(n.named_parameters(), cfg, **HP), steps=5)
    per_col = (after["conv.weight"] != before).view(6, 27).sum(0)
    assert sorted(per_col.tolist()) == [0] * 22 + [6] * 5
