"""The hook path (offload/stream.py): gradients leave during the last backward of a step and are
accumulated off step(); the parameters are bit-identical to the step() path."""

from __future__ import annotations

import io
import math

import pytest
import torch
from test_offload_helpers import batches, snapshot, tiny_net

from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer

HP = {"lr": 1e-2, "weight_decay": 0.01}
BASE = {"topk_ratio": 0.1, "update_interval": 3, "select_strategy": "step", "select_interval": 6}


def run(model, opt, data, *, hooks: bool, micro: int = 2) -> list:
    """Gradient accumulation over ``micro`` micro-batches per step (the loop's call pattern)."""
    out = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            loss = torch.nn.functional.mse_loss(model(xs).float(), ys.float()) / micro
            if hooks:
                opt.prepare_backward(final=i == micro - 1)
            opt.scale_loss(loss).backward()
        out.append(opt.step())
    return out


def train(cfg: ZenFlowConfig, *, hooks: bool, steps: int = 14, dtype=torch.float32, clip=None):
    model = tiny_net(dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        stats = run(model, opt, batches(steps, dtype=dtype), hooks=hooks)
        opt.flush()
    return snapshot(model), stats


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["coef-known", "clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hook_path_is_bit_identical_to_step_path(overlap, clip, dtype) -> None:
    cfg = ZenFlowConfig(overlap_step=overlap, full_warm_up_rounds=1, **BASE)
    ref, ref_stats = train(cfg, hooks=False, dtype=dtype, clip=clip)
    got, stats = train(cfg, hooks=True, dtype=dtype, clip=clip)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    keys = ("boundary", "selection", "installed", "grad_norm", "d2h_bytes", "h2d_bytes")
    assert [[getattr(s, k) for k in keys] for s in ref_stats] == [[getattr(s, k) for k in keys] for s in stats]
    assert sum(s.boundary for s in stats) >= 4 and sum(s.selection for s in stats) >= 2


def test_auto_interval_and_stream_grads_off() -> None:
    cfg = ZenFlowConfig(topk_ratio=0.2, update_interval="auto", auto_ratio=0.5)
    ref, _ = train(cfg, hooks=False, clip=1.0)
    got, stats = train(cfg, hooks=True, clip=1.0)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    off, stats_off = train(ZenFlowConfig(topk_ratio=0.2, update_interval="auto", auto_ratio=0.5,
                                         stream_grads=False), hooks=True, clip=1.0)
    assert all(torch.equal(ref[n], off[n]) for n in ref)
    assert all(s.early_chunks == 0 for s in stats_off) and any(s.early_chunks for s in stats)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["coef-known", "clip"])
def test_step_leaves_no_gradient_work_for_itself(clip) -> None:
    """The CPU-testable property: with the hook path, step() copies no gradient chunk itself; every
    chunk left during backward and was accumulated before step() (coefficient known in advance)
    or by the host thread after it (clip: the coefficient needs every gradient first)."""
    cfg = ZenFlowConfig(overlap_step=True, **BASE)
    _, ref = train(cfg, hooks=False, clip=clip)
    _, stats = train(cfg, hooks=True, clip=clip)
    for r, s in zip(ref, stats):
        if s.selection:  # a re-selection re-plans the chunks: that step takes the step() path
            assert s.in_step_chunks == r.in_step_chunks > 0 and s.early_chunks == 0
            continue
        assert s.in_step_chunks == 0 and s.early_chunks == r.in_step_chunks > 0
        assert s.early_bytes == r.in_step_bytes
        if clip is None:
            assert s.accumulated_early == s.early_chunks and s.accumulated_late == 0
        else:
            assert s.accumulated_late == s.early_chunks and s.accumulated_early == 0


def test_only_the_final_backward_streams() -> None:
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), ZenFlowConfig(**BASE), **HP) as opt:
        run(model, opt, batches(1, seed=3), hooks=True)  # step 0 selects (the step() path)
        (x, y), = batches(1)
        opt.zero_grad(set_to_none=True)
        opt.prepare_backward(final=False)
        torch.nn.functional.mse_loss(model(x), y).backward()
        assert not opt._stream.landed  # gradients are not final yet: nothing moved
        opt.prepare_backward(final=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        assert opt._stream.landed
        stats = opt.step()
    assert stats.early_chunks > 0 and stats.in_step_chunks == 0


def test_fp16_overflow_drops_the_streamed_gradient() -> None:
    model = tiny_net(dtype=torch.float16)
    cfg = ZenFlowConfig(**BASE)
    data = batches(6, dtype=torch.float16)
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-3) as opt:
        run(model, opt, data[:4], hooks=True)
        opt._drain()  # fp16: step 4's chunks are added after step() returned; read the sum after them
        acc = opt.pipeline.acc.clone()
        x, y = data[4]
        opt.zero_grad(set_to_none=True)
        opt.prepare_backward(final=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        opt.scale_loss(loss * math.inf).backward()
        stats = opt.step()
        assert stats.skipped
        opt._drain()
        assert torch.equal(acc, opt.pipeline.acc)  # nothing was added
        assert not run(model, opt, data[5:], hooks=True)[0].skipped


@pytest.mark.parametrize("stop", [4, 5])
def test_resume_with_accumulation_in_flight_is_bit_identical(stop: int) -> None:
    cfg, data = ZenFlowConfig(overlap_step=True, **BASE), batches(12)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
        run(model, opt, data, hooks=True)
    expected = snapshot(model)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
        run(model, opt, data[:stop], hooks=True)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model = tiny_net(seed=7)
    model.load_state_dict(saved["model"])
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
        opt.load_state_dict(saved["opt"])
        run(model, opt, data[stop:], hooks=True)
    got = snapshot(model)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_a_second_final_backward_is_refused() -> None:
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), ZenFlowConfig(**BASE), **HP) as opt:
        run(model, opt, batches(1, seed=3), hooks=True)
        (x, y), = batches(1)
        opt.prepare_backward(final=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match="announces ONE backward"):
            torch.nn.functional.mse_loss(model(x), y).backward()


@pytest.mark.parametrize("hooks", [False, True], ids=["step-path", "hook-path"])
def test_first_step_without_a_gradient_is_a_zero_sum(hooks: bool) -> None:
    """The interval's first step writes the accumulator instead of adding (no zeroing pass), so a
    matrix without a gradient at that step must write zeros, not keep an older interval's sum."""
    cfg = ZenFlowConfig(overlap_step=True, **BASE)  # intervals [0,2], [3,5], [6,8]: acc0 again at 6

    def go(hook_path: bool, zeros: bool):
        model = tiny_net()
        with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
            for t, (x, y) in enumerate(batches(10)):
                opt.zero_grad(set_to_none=True)
                model.fc2.weight.requires_grad_(t != 6)
                if hook_path:
                    opt.prepare_backward(final=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                model.fc2.weight.requires_grad_(True)
                if zeros and t == 6:
                    model.fc2.weight.grad = torch.zeros_like(model.fc2.weight)
                opt.step()
            opt.flush()
        return snapshot(model)

    ref, got = go(False, zeros=True), go(hooks, zeros=False)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
