"""adamw_sum: AdamW on an interval's gradient sum formed from its per-step slots in the same pass.

The contract is bit identity with what the host path computed before the slots existed: each
step's gradient accumulated into an fp32 buffer with its own coefficient (``accumulate``, the
interval's first step with ``overwrite``, or on top of a resumed partial sum), then ``adamw_step``
on that buffer. The reference below is exactly that sequence of calls, on every ISA path this CPU
has (the `isa` fixture), every slot and output dtype, run lists with tails, ``repeat`` and any
thread count.
"""

from __future__ import annotations

import pytest
import torch

from zfctl import _native as N

HP = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
RUNS = torch.tensor([[0, 1], [3, 17], [40, 1000], [1041, 2], [2000, 2099]])  # odd offsets and lengths


def _slots(n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[list[torch.Tensor], list[float]]:
    gen = torch.Generator().manual_seed(seed)
    slots = [(torch.randn(n, generator=gen) * (1 + s)).to(dtype) for s in range(k)]
    # clip factors below one, an fp16 unscale (a power of two), and exactly 1
    coefs = [0.37, 2.0**-14, 1.0, 0.8125][:k]
    return slots, coefs


def _reference(p, m, v, slots, coefs, carry, hp, runs=None, out=None, repeat=1) -> torch.Tensor:
    """Today's host path: accumulate each step into an fp32 buffer, then one adamw_step on it."""
    acc = carry.clone() if carry is not None else torch.full_like(p, float("nan"))
    for i, (s, c) in enumerate(zip(slots, coefs)):
        N.accumulate(acc, s, scale=c, overwrite=carry is None and i == 0)
    N.adamw_step(p, acc, m, v, runs=runs, out=out, repeat=repeat, **hp)
    return acc


def _state(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("odt", [None, torch.bfloat16, torch.float16], ids=["no-out", "out-bf16", "out-f16"])
@pytest.mark.parametrize("k, carried", [(1, False), (4, False), (2, True), (0, True)],
                         ids=["1-slot", "4-slots", "carry+2", "carry-only"])
def test_sum_is_accumulate_then_adamw(isa, sdt, odt, k, carried) -> None:
    n = 4099  # a multiple-of-16 body plus a 3-element tail through the padded path
    slots, coefs = _slots(n, k, sdt, seed=k)
    carry = torch.randn(n, generator=torch.Generator().manual_seed(9)) if carried else None
    for step, adamw, wd, beta1, runs in [(1, True, 0.01, 0.9, None), (7, False, 0.1, 0.3, RUNS), (3, True, 0.0, 0.9, RUNS)]:
        hp = {**HP, "beta1": beta1, "step": step, "weight_decay": wd, "adamw": adamw, "grad_scale": 1 / max(k, 1)}
        p, m, v = _state(n, seed=step)
        q, mq, vq = p.clone(), m.clone(), v.clone()
        out = torch.zeros(n, dtype=odt) if odt is not None else None
        outq = out.clone() if out is not None else None
        _reference(q, mq, vq, slots, coefs, carry, hp, runs=runs, out=outq)
        N.adamw_sum(p, m, v, slots, coefs, carry=carry, runs=runs, out=out, **hp)
        assert torch.equal(p, q) and torch.equal(m, mq) and torch.equal(v, vq), (step, adamw)
        if out is not None:
            assert torch.equal(out, outq)


def test_repeat_is_the_same_as_on_the_accumulated_sum(isa) -> None:
    """zenflow.deferred_lr_scale: repeat (n AdamW steps with the interval's gradient, one pass):
    100 steps, more than one pass of ZF_MAX_REPEAT, re-form the sum each pass to the same bits."""
    n = 1037
    slots, coefs = _slots(n, 3, torch.bfloat16, seed=5)
    for repeat in (4, 100):
        hp = {**HP, "step": 5, "weight_decay": 0.02, "grad_scale": 1 / 3}
        p, m, v = _state(n, seed=6)
        q, mq, vq = p.clone(), m.clone(), v.clone()
        _reference(q, mq, vq, slots, coefs, None, hp, repeat=repeat)
        N.adamw_sum(p, m, v, slots, coefs, repeat=repeat, **hp)
        assert torch.equal(p, q) and torch.equal(m, mq) and torch.equal(v, vq), repeat


def test_special_values_and_the_negative_zero_slot(isa) -> None:
    """Infinities, NaN, signed zeros and denormals go through the fma chain as through accumulate;
    a slot of -0.0 (what the engine writes for a matrix without a gradient at a step) leaves the
    sum exactly as it was, -0.0 included, as skipping the accumulate did."""
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3.0e38, -1.0])
    n = 16 * 9 + 5
    i = torch.arange(n)
    a, b = specials[i % 9], specials[(i // 9) % 9]  # every pair of specials (81 < n)
    hp = {**HP, "step": 2, "weight_decay": 0.0, "grad_scale": 0.5}
    for dtype in (torch.float32, torch.bfloat16):
        # 2^-30: -1e-40 times it underflows to -0.0, the one way a sum of +0-started fmas gets one
        slots, coefs = [a.to(dtype), b.to(dtype), torch.full((n,), -0.0, dtype=dtype)], [2.0**-30, 2.0**-10, 0.5]
        p, m, v = _state(n, seed=4)
        q, mq, vq = p.clone(), m.clone(), v.clone()
        acc = _reference(q, mq, vq, slots[:2], coefs[:2], None, hp)  # the -0 slot skipped
        N.adamw_sum(p, m, v, slots, coefs, **hp)
        for x, y in ((p, q), (m, mq), (v, vq)):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32))  # NaNs and zero signs too
        with_zero = acc.clone()
        N.accumulate(with_zero, slots[2], scale=coefs[2])  # fma(-0, c, a) == a, bit for bit
        assert torch.equal(with_zero.view(torch.int32), acc.view(torch.int32))
        assert bool(((acc == 0) & torch.signbit(acc)).any())  # a -0.0 of the sum went through unchanged


def test_a_carry_alone_is_the_fp32_gradient_itself(isa) -> None:
    """The device path hands the worker its fp32 interval sum as a carry with no slots: the same
    bits as adamw_step on that buffer, -0.0 elements included (an fma into +0 would turn them +0)."""
    n = 2053
    g = torch.randn(n, generator=torch.Generator().manual_seed(8))
    g[::7] = -0.0
    hp = {**HP, "step": 4, "weight_decay": 0.01, "grad_scale": 0.25}
    p, m, v = _state(n, seed=2)
    q, mq, vq = p.clone(), m.clone(), v.clone()
    N.adamw_step(q, g, mq, vq, **hp)
    N.adamw_sum(p, m, v, [], [], carry=g, **hp)
    assert torch.equal(p, q) and torch.equal(m, mq) and torch.equal(v, vq)


def test_every_path_and_thread_count_gives_the_scalar_bits() -> None:
    """1M + 5 elements (the pool is used from 512K) with run boundaries inside tiles: 1..4 threads
    on every path this CPU has give the single-threaded scalar result."""
    n = (1 << 20) + 5
    runs = torch.tensor([[5, 500001], [500010, 3], [500020, 548553]])
    slots, coefs = _slots(n, 3, torch.bfloat16, seed=11)
    carry = torch.randn(n, generator=torch.Generator().manual_seed(12))
    hp = {**HP, "step": 3, "weight_decay": 0.01, "grad_scale": 0.2}
    start = _state(n, seed=13)
    before_isa, before_nt, joins = N.isa(), N.get_num_threads(), N.pool_joins()
    results = []
    try:
        for attempt in range(10):  # repeat until a pool thread joined at least once (test_native_adam)
            for name in N.available_isas():
                N.set_isa(name)
                for nt in (1, 2, 4):
                    N.set_num_threads(nt)
                    p, m, v = (t.clone() for t in start)
                    out = torch.zeros(n, dtype=torch.bfloat16)
                    N.adamw_sum(p, m, v, slots, coefs, carry=carry, runs=runs, out=out, **hp)
                    results.append((p, m, v, out))
            if N.pool_joins() > joins:
                break
    finally:
        N.set_isa(before_isa)
        N.set_num_threads(before_nt)
    assert N.pool_joins() > joins, "no pool thread ever joined: the multi-thread path went untested"
    first = results[0]
    assert all(all(torch.equal(a, b) for a, b in zip(r, first)) for r in results[1:])


def test_arguments_are_checked() -> None:
    n = 64
    p, m, v = _state(n, seed=1)
    s = torch.zeros(n, dtype=torch.bfloat16)
    hp = {**HP, "step": 1, "weight_decay": 0.0}
    with pytest.raises(ValueError, match="2 slots but 1 coefficients"):
        N.adamw_sum(p, m, v, [s, s], [1.0], **hp)
    with pytest.raises(ValueError, match="at least one slot or a carry"):
        N.adamw_sum(p, m, v, [], [], **hp)
    with pytest.raises(ValueError, match=f"at most {N.MAX_SLOTS}"):
        N.adamw_sum(p, m, v, [s] * (N.MAX_SLOTS + 1), [1.0] * (N.MAX_SLOTS + 1), **hp)
    with pytest.raises(ValueError, match="one dtype for all"):
        N.adamw_sum(p, m, v, [s, s.half()], [1.0, 1.0], **hp)
    with pytest.raises(ValueError, match=r"slots\[1\]: has 32 elements"):
        N.adamw_sum(p, m, v, [s, s[:32]], [1.0, 1.0], **hp)
    with pytest.raises(ValueError, match="carry: dtype must be float32"):
        N.adamw_sum(p, m, v, [s], [1.0], carry=s, **hp)
    with pytest.raises(ValueError, match="overlap in memory"):
        N.adamw_sum(p, m, v, [p], [1.0], **hp)
    N.adamw_sum(p, m, v, [s] * N.MAX_SLOTS, [1.0] * N.MAX_SLOTS, **hp)  # the most slots: accepted
