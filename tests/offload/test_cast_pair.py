"""The gradient pair's dtype-changing gather and scatter (departure.py ``gather_cast``,
``scatter_cast``): the same bits as the two-step reference (gather then widen; narrow then
``index_copy_``), and no temporary larger than the bounded scratch."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from zfctl.offload.columns import departure
from zfctl.offload.columns.departure import gather_cast, scatter_cast


def _largest_alloc(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def _data(monkeypatch, n_host=300, n=200, w=64):
    monkeypatch.setattr(departure, "CAST_BYTES", 16 * w * 2)  # 16-row blocks: several blocks and a tail
    g = torch.Generator().manual_seed(0)
    host = (torch.randn(n_host, w, generator=g) * 1e3).to(torch.bfloat16)
    host[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-40]).to(torch.bfloat16)
    cols = torch.randperm(n_host, generator=g)[:n]
    rows = torch.randn(n, w, generator=g) * 1e3  # fp32, not all representable: narrowing rounds
    return host, cols, rows


def test_gather_cast_widens_same_bits_no_full_temporary(monkeypatch):
    host, cols, _ = _data(monkeypatch)
    out = torch.empty(cols.numel(), host.shape[1])
    ref = host.index_select(0, cols).to(torch.float32)
    full = ref.numel() * host.element_size()
    assert _largest_alloc(lambda: gather_cast(host, cols, out)) < full // 4
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def test_scatter_cast_narrows_same_bits_no_full_temporary(monkeypatch):
    host, cols, rows = _data(monkeypatch)
    ref = host.clone()
    ref.index_copy_(0, cols, rows.to(torch.bfloat16))  # round to nearest even, as before
    full = rows.numel() * host.element_size()
    assert _largest_alloc(lambda: scatter_cast(host, cols, rows)) < full // 4
    assert torch.equal(host.view(torch.int16), ref.view(torch.int16))


def test_same_dtype_is_one_op(monkeypatch):
    host, cols, rows = _data(monkeypatch)
    host32, out = host.float(), torch.empty(cols.numel(), host.shape[1])
    gather_cast(host32, cols, out)
    assert torch.equal(out.view(torch.int32), host32.index_select(0, cols).view(torch.int32))
    ref = host32.clone().index_copy_(0, cols, rows)
    scatter_cast(host32, cols, rows)
    assert torch.equal(host32.view(torch.int32), ref.view(torch.int32))
