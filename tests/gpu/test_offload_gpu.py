"""The CUDA path of the ZenFlow optimizer: real streams, pinned rings, events (``pytest -m gpu``).

Same acceptance as the CPU tests, plus agreement between the CUDA and the CPU implementation of
the same configuration (rings, transposes and installs are the parts that differ).
"""

from __future__ import annotations

import io

import pytest
import torch
from test_offload_helpers import batches, max_rel_err, snapshot, tiny_net, train

from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer

pytestmark = pytest.mark.gpu
# fc2 and head stand in for the vocabulary matrices: split by row where a config says vocab_select: rows.
HP = {"lr": 1e-2, "weight_decay": 0.01, "vocab_params": ["fc2.weight", "head.weight"]}
ZEN = {"topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step", "select_interval": 12}


def zen_run(cfg: ZenFlowConfig, device: str, steps: int = 24, dtype=torch.float32, clip=None):
    model = tiny_net(device=device, dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        stats = train(model, opt, steps)
        opt.flush()
    return {n: p.cpu() for n, p in snapshot(model).items()}, stats


@pytest.fixture(autouse=True)
def _exact_matmuls():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("cfg", [ZenFlowConfig(topk_ratio=1.0),
                                 ZenFlowConfig(topk_ratio=0.0, update_interval=1, overlap_step=False)],
                         ids=["r=1", "r=0,U=1"])
@pytest.mark.parametrize("clip", [None, 0.25])
def test_cuda_limits_reproduce_torch_adamw(cfg, clip) -> None:
    model = tiny_net(device="cuda")
    train(model, torch.optim.AdamW(model.parameters(), lr=HP["lr"], weight_decay=HP["weight_decay"]), 50, clip=clip)
    ref = {n: p.cpu() for n, p in snapshot(model).items()}
    got, _ = zen_run(cfg, "cuda", steps=50, clip=clip)
    assert max_rel_err(got, ref) <= 1e-5


@pytest.mark.parametrize(("overlap", "extra"), [(False, {}), (True, {}),
                                                (True, {"vocab_select": "rows", "install_lag": 1})],
                         ids=["sequential", "overlap", "overlap-rows-lag1"])
def test_cuda_matches_cpu_implementation(overlap: bool, extra: dict) -> None:
    cfg = ZenFlowConfig(overlap_step=overlap, **ZEN, **extra)
    cpu, cpu_stats = zen_run(cfg, "cpu")
    gpu, gpu_stats = zen_run(cfg, "cuda")
    assert [s.installed for s in cpu_stats] == [s.installed for s in gpu_stats]
    assert [s.d2h_bytes for s in cpu_stats] == [s.d2h_bytes for s in gpu_stats]
    assert max_rel_err(gpu, cpu) <= 1e-4  # matmul kernels differ, the optimizer must not


def test_cuda_bit_identical_across_runs_slots_and_pinning() -> None:
    base, _ = zen_run(ZenFlowConfig(**ZEN), "cuda")
    for kw in ({}, {"ring_slots": 1, "ring_slot_mb": 0.0005}, {"pin_memory": False}):
        other, _ = zen_run(ZenFlowConfig(**ZEN, **kw), "cuda")
        assert all(torch.equal(base[n], other[n]) for n in base), kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_resume_mid_interval_is_bit_identical(dtype) -> None:
    cfg, data = ZenFlowConfig(**ZEN), batches(20, dtype=dtype)

    def steps(model, opt, chunk):
        for x, y in chunk:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x.cuda()).float(), y.cuda().float()).backward()
            opt.step()

    model = tiny_net(device="cuda", dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        steps(model, opt, data)
    expected = snapshot(model)
    model = tiny_net(device="cuda", dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        steps(model, opt, data[:10])
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model = tiny_net(seed=5, device="cuda", dtype=dtype)
    model.load_state_dict(saved["model"])
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        opt.load_state_dict(saved["opt"])
        steps(model, opt, data[10:])
    got = snapshot(model)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_cuda_fp16_overflow_skips_and_bf16_trains() -> None:
    model = tiny_net(device="cuda", dtype=torch.float16)
    with ZenFlowOptimizer(model.named_parameters(), ZenFlowConfig(**ZEN), lr=1e-3) as opt:
        x, y = (t.cuda().half() for t in batches(1)[0])
        opt.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y.float())).backward()
        model.fc2.weight.grad[0, 0] = float("inf")
        before = snapshot(model)
        stats = opt.step()
        assert stats.skipped and opt._scaler.scale == 2**15
        assert all(torch.equal(before[n], p) for n, p in snapshot(model).items())
    model = tiny_net(device="cuda", dtype=torch.bfloat16)
    with ZenFlowOptimizer(model.named_parameters(), ZenFlowConfig(**ZEN, overlap_step=True), lr=1e-2) as opt:
        stats = train(model, opt, 24)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum(s.h2d_bytes for s in stats) > 0 and all(s.d2h_bytes > 0 for s in stats)


def _micro_run(cfg: ZenFlowConfig, *, hooks: bool, dtype, clip, steps: int = 16):
    """Gradient accumulation over 2 micro-batches on CUDA; ``hooks``: the stream path."""
    model = tiny_net(device="cuda", dtype=dtype)
    stats = []
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        for x, y in batches(steps, dtype=dtype):
            opt.zero_grad(set_to_none=True)
            for i, (xs, ys) in enumerate(zip(x.cuda().chunk(2), y.cuda().chunk(2))):
                if hooks:
                    opt.prepare_backward(final=i == 1)
                (torch.nn.functional.mse_loss(model(xs).float(), ys.float()) / 2).backward()
            stats.append(opt.step())
        opt.flush()
    return {n: p.cpu() for n, p in snapshot(model).items()}, stats


@pytest.mark.parametrize("clip", [None, 0.5], ids=["coef-known", "clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kw", [{}, {"ring_slots": 1, "ring_slot_mb": 0.0005}, {"pin_memory": False},
                                {"vocab_select": "rows"}],
                         ids=["default", "tiny-budget", "pageable", "rows"])
def test_cuda_hook_path_is_bit_identical_to_step_path(clip, dtype, kw) -> None:
    """Copy stream, events, pinned landing buffers and the accumulation thread change no bit."""
    cfg = ZenFlowConfig(overlap_step=True, **ZEN, **kw)
    ref, _ = _micro_run(cfg, hooks=False, dtype=dtype, clip=clip)
    got, stats = _micro_run(cfg, hooks=True, dtype=dtype, clip=clip)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    streamed = [s for s in stats if not s.selection]
    assert streamed and all(s.early_chunks > 0 and s.in_step_chunks == 0 for s in streamed)


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
def test_cuda_device_accumulation_matches_host(dtype) -> None:
    """accumulate=device: the fp32 sum on the GPU, one pinned async D2H per interval. fp32 only:
    in bf16 one ulp of the fp32 sum can flip a weight's rounding, which no tolerance on the
    sum bounds."""
    host, hs = zen_run(ZenFlowConfig(accumulate="host", **ZEN), "cuda", dtype=dtype, clip=0.5)
    dev, ds = zen_run(ZenFlowConfig(accumulate="device", **ZEN), "cuda", dtype=dtype, clip=0.5)
    assert max_rel_err(dev, host) <= 1e-6
    assert [s.installed for s in hs] == [s.installed for s in ds]
    assert all(d.d2h_bytes < h.d2h_bytes for h, d in zip(hs, ds) if not d.boundary and not d.selection)


def test_cuda_d2h_probe_sizes_the_inflight_budget() -> None:
    from zfctl.offload.bandwidth import MAX_BYTES, MIN_BYTES, inflight_bytes

    model = tiny_net().cuda()
    cfg = ZenFlowConfig(topk_ratio=0.1, update_interval=2, stream_grads=True)
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2) as opt:
        assert opt.d2h_gbps is not None and opt.d2h_gbps > 0
        want = min(inflight_bytes(opt.d2h_gbps), opt.layout.host_numel * opt._itemsize)
        assert opt._stream.budget_bytes == want and want <= MAX_BYTES
        assert MIN_BYTES <= inflight_bytes(opt.d2h_gbps)
