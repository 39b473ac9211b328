"""accumulate and sq_norm: against torch, across ISA paths, run lists and thread counts.

The `isa` fixture (tests/conftest.py) runs a test once per path this CPU has and skips the rest.
accumulate is one fma per element, a single correctly rounded operation, so comparing it with
torch's add_(alpha=) bit for bit asserts IEEE arithmetic, not an implementation's rounding.
"""

from __future__ import annotations

import pytest
import torch

from zfctl import _native as N


def _all_halves(dtype: torch.dtype) -> torch.Tensor:
    """Every one of the 65536 bit patterns of a 16-bit float type."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widening_every_half_value(isa, dtype):
    """acc = 0 + 1*g is g widened to fp32: exactly torch's .float() for all 65536 inputs."""
    g = _all_halves(dtype)
    acc = torch.zeros(g.numel())
    N.accumulate(acc, g)
    expect = g.float()
    nan = expect.isnan()
    assert torch.equal(acc.isnan(), nan)
    assert torch.equal(acc[~nan], expect[~nan])


@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16])
def test_accumulate_matches_torch(isa, gdt):
    n = 2053
    gen = torch.Generator().manual_seed(0)
    acc = torch.randn(n, generator=gen)
    ref = acc.clone()
    for scale in (1.0, 0.25, -3.0):
        g = torch.randn(n, generator=gen).to(gdt)
        N.accumulate(acc, g, scale=scale)
        ref.add_(g.float(), alpha=scale)  # torch fuses this into one fma as well
    assert torch.equal(acc, ref)


@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16])
def test_overwrite_is_accumulating_into_zeros(isa, gdt):
    """overwrite=True (the first gradient of an interval) gives the bits of a zeroed accumulator
    plus one accumulate, never reads the old contents (NaN here), and leaves other runs alone."""
    n = 1037  # not a multiple of the SIMD block: the tail path too
    runs = torch.tensor([[0, 5], [7, 600], [700, 337]])
    inside = torch.zeros(n, dtype=torch.bool)
    for off, length in runs.tolist():
        inside[off : off + length] = True
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(n, generator=gen).to(gdt)
    acc = torch.full((n,), float("nan"))
    N.accumulate(acc, g, scale=-0.7, runs=runs, overwrite=True)
    ref = torch.zeros(n)
    N.accumulate(ref, g, scale=-0.7, runs=runs)
    assert torch.equal(acc[inside], ref[inside]) and acc[~inside].isnan().all()


def test_accumulate_runs_and_paths_bit_identical():
    n = 1001
    runs = torch.tensor([[0, 3], [3, 0], [10, 17], [500, 501]])
    inside = torch.zeros(n, dtype=torch.bool)
    for off, length in runs.tolist():
        inside[off : off + length] = True
    gen = torch.Generator().manual_seed(1)
    start, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    before, results = N.isa(), []
    for name in N.available_isas():
        N.set_isa(name)
        acc = start.clone()
        N.accumulate(acc, g, scale=0.3, runs=runs)
        results.append(acc)
    N.set_isa(before)
    whole = start.clone()
    N.accumulate(whole, g, scale=0.3)
    for acc in results:
        assert torch.equal(acc, results[0])
        assert torch.equal(acc[inside], whole[inside]) and torch.equal(acc[~inside], start[~inside])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sq_norm_matches_float64(isa, dtype):
    x = torch.randn(70_001, generator=torch.Generator().manual_seed(2)).to(dtype)
    expect = x.double().square().sum().item()
    assert N.sq_norm(x) == pytest.approx(expect, rel=1e-12)
    runs = torch.tensor([[1, 2], [7, 33_000], [40_000, 30_001]])
    expect_runs = sum(x[o : o + n].double().square().sum().item() for o, n in runs.tolist())
    assert N.sq_norm(x, runs=runs) == pytest.approx(expect_runs, rel=1e-12)


def test_sq_norm_small_and_empty(isa):
    assert N.sq_norm(torch.tensor([3.0])) == 9.0
    assert N.sq_norm(torch.empty(0)) == 0.0
    assert N.sq_norm(torch.ones(10), runs=torch.empty(0, 2, dtype=torch.int64)) == 0.0
    assert N.sq_norm(torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)) == 5.25
    assert N.sq_norm(torch.tensor([float("inf"), 1.0])) == float("inf")


def test_sq_norm_same_bits_for_every_thread_count_and_path():
    """The reduction order is fixed by the data: 1..6 threads and all paths give the same double."""
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(3)) * 1e3
    runs = torch.tensor([[0, 17], [20, 400_000], [400_021, 599_982]])
    before_isa, before_nt, joins = N.isa(), N.get_num_threads(), N.pool_joins()
    seen = set()
    for attempt in range(10):  # repeat until a pool thread joined at least once (see test_native_adam)
        for name in N.available_isas():
            N.set_isa(name)
            for nt in range(1, 7):
                N.set_num_threads(nt)
                seen.add((N.sq_norm(x), N.sq_norm(x, runs=runs), N.sq_norm(x.to(torch.bfloat16))))
        if N.pool_joins() > joins:
            break
    N.set_isa(before_isa)
    N.set_num_threads(before_nt)
    assert N.pool_joins() > joins, "no pool thread ever joined: the multi-thread path went untested"
    assert len(seen) == 1
