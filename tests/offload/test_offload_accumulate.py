"""``zenflow.accumulate: device``: the interval sum on the device gives the parameters of the host sum."""

from __future__ import annotations

import io

import pytest
import torch
from test_offload_helpers import batches, max_rel_err, snapshot, tiny_net, train, zen

from zfctl.errors import ConfigError
from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer
from zfctl.offload.grads.device_acc import resolve
from zfctl.offload.layout import num_selected

HP = {"lr": 1e-2, "weight_decay": 0.01}
BASE = {"topk_ratio": 0.1, "update_interval": 3, "select_interval": 6}


def run(accumulate: str, *, overlap: bool = True, clip=None, dtype=torch.float32, steps: int = 20):
    model = tiny_net(dtype=dtype)
    cfg = zen(accumulate=accumulate, overlap_step=overlap, full_warm_up_rounds=1, **BASE)
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        assert opt.accumulate == accumulate
        stats = train(model, opt, steps)
        opt.flush()
    return snapshot(model), stats


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_device_and_host_accumulation_give_the_same_parameters(overlap, clip, dtype) -> None:
    """fp16: the device sum takes each step's unscale u (a device scalar), the host slots record
    it, and both take the interval's mean clip factor at the boundary (the interval-mean rule)."""
    host, hs = run("host", overlap=overlap, clip=clip, dtype=dtype)
    dev, ds = run("device", overlap=overlap, clip=clip, dtype=dtype)
    # Same sum order; the only difference is fma vs multiply-then-add rounding in the adds.
    assert max_rel_err(dev, host) <= 1e-6
    assert [s.installed for s in hs] == [s.installed for s in ds]
    # Only the interval sum's host-owned columns cross PCIe (fp32, at boundaries; the device-owned
    # ones only where they ride along inside a span); no per-step gradient traffic.
    mats = [p for p in tiny_net().parameters() if p.dim() == 2]
    matrices = sum(p.numel() for p in mats)
    selected = sum(num_selected(p.shape[1], BASE["topk_ratio"]) * p.shape[0] for p in mats)
    for h, d in zip(hs, ds):
        assert d.host_bytes < h.host_bytes or d.boundary
        if not d.boundary and not d.selection:
            assert d.d2h_bytes < h.d2h_bytes
        if d.boundary:
            assert 4 * (matrices - selected) <= d.d2h_bytes <= 4 * matrices + 64


def test_device_mode_resumes_mid_interval_bit_identically() -> None:
    cfg, data = zen(accumulate="device", overlap_step=True, **BASE), batches(14)

    def steps(model, opt, chunk):
        for x, y in chunk:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
        steps(model, opt, data)
    expected = snapshot(model)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
        steps(model, opt, data[:5])  # mid-interval, an update in flight
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model = tiny_net(seed=9)
    model.load_state_dict(saved["model"])
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
        opt.load_state_dict(saved["opt"])
        steps(model, opt, data[5:])
    got = snapshot(model)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_auto_resolves_to_host_without_cuda_and_bad_values_are_refused() -> None:
    params = list(tiny_net().parameters())
    assert resolve("auto", torch.device("cpu"), 10, params) == "host"
    assert resolve("device", torch.device("cpu"), 10, params) == "device"
    with ZenFlowOptimizer(tiny_net().named_parameters(), zen(**BASE)) as opt:
        assert opt.accumulate == "host"
    with pytest.raises(ConfigError, match="zenflow.accumulate"):
        ZenFlowConfig(accumulate="gpu").validate()


def test_device_path_keeps_one_host_accumulator_and_collects_before_it_copies_out(monkeypatch) -> None:
    """One host accumulator on the device path: the boundary collects the previous CPU update (which
    may still read that accumulator), then copies the new interval's sum into it, then submits.
    A CPU worker slowed down to outlast the next interval changes no bit; copying out first (the
    sum lands while the slow worker still reads the last one) would."""
    from zfctl.offload.cpu.worker import CpuWorker

    straight, _ = run("device")
    slow_run = CpuWorker.run

    def slow(self, update):
        import time

        time.sleep(0.05)  # the next interval's steps run meanwhile: the worker reads the sum late
        return slow_run(self, update)

    monkeypatch.setattr(CpuWorker, "run", slow)
    model = tiny_net()
    cfg = zen(accumulate="device", overlap_step=True, full_warm_up_rounds=1, **BASE)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        assert opt.host is not None and opt.host.grads.sets == 1 and opt.host.grads.per_set == 0
        train(model, opt, 20)
        opt.flush()
    got = snapshot(model)
    assert all(torch.equal(straight[n], got[n]) for n in straight)
