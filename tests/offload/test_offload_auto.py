"""update_interval=auto (docs/design.md, section "Algorithm"): the rule fires exactly where its
arithmetic says, the next step is the boundary, and auto_min_interval/auto_max_interval bound it."""

from __future__ import annotations

import pytest
import torch
from test_offload_helpers import zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.cpu.auto_interval import IntervalPolicy


def boundaries(policy: IntervalPolicy, stream, steps: int) -> list[int]:
    """Drive the policy like the optimizer does: boundary test first, then observe (if none)."""
    out, length = [], 0
    for t in range(steps):
        length += 1
        if policy.is_boundary(length):
            out.append(t)
            policy.reset()
            length = 0
        else:
            policy.observe(*stream(t))
    return out


def one_matrix(t: int):
    # k=1 of 11 columns. Selected: 10 per column per step. Deferred: 20 over 10 columns = 2 per
    # column per step. After n steps D = 2n vs A = 10: fires at n = 5, boundary at the 6th step.
    return [10.0], [30.0], [1], [11]


def test_rule_fires_where_the_arithmetic_says() -> None:
    assert boundaries(IntervalPolicy("auto"), one_matrix, 20) == [5, 11, 17]


def test_bounds() -> None:
    assert boundaries(IntervalPolicy("auto", max_interval=4), one_matrix, 12) == [3, 7, 11]
    assert boundaries(IntervalPolicy("auto", min_interval=8), one_matrix, 20) == [7, 15]  # fired, waited


def test_ratio_counts_matrices() -> None:
    def two(t: int):  # matrix 0 qualifies after 5 steps, matrix 1 (D = 4n vs A = 12) after 3
        return [10.0, 12.0], [30.0, 52.0], [1, 1], [11, 11]

    assert boundaries(IntervalPolicy("auto", auto_ratio=0.99), two, 12) == [5, 11]
    assert boundaries(IntervalPolicy("auto", auto_ratio=0.5), two, 12) == [3, 7, 11]


def test_running_mean_of_selected_mass() -> None:
    # Selected mass 30 then 10, 10, ...: A = mean per step (30, 20, 16.7, 15, 14), D = 2n: fires at
    # n = 7 (D 14 >= A 12.86), boundary at the 8th step. A sum instead of a mean would never fire.
    def stream(t: int):
        return [30.0 if t in (0, 8) else 10.0], [50.0 if t in (0, 8) else 30.0], [1], [11]

    assert boundaries(IntervalPolicy("auto"), stream, 16) == [7, 15]


def test_fixed_interval() -> None:
    assert boundaries(IntervalPolicy(3), one_matrix, 9) == [2, 5, 8]


ROWS, COLS, LOUD = 64, 32, [3, 7, 19, 30]


def constant_grads(layer: torch.nn.Linear, step: int) -> None:
    """|g| = 1 on the loud columns and 1/8 elsewhere, random signs: per-column L1 = 64 vs 8, exact."""
    g = torch.Generator().manual_seed(step)
    mag = torch.full((ROWS, COLS), 0.125)
    mag[:, LOUD] = 1.0
    sign = torch.randint(0, 2, (ROWS, COLS), generator=g) * 2 - 1
    layer.weight.grad = mag * sign
    layer.bias.grad = torch.randn(ROWS, generator=g)


@pytest.mark.parametrize(("bounds", "expected"), [
    ({}, [8, 17, 26]),  # D = 8n reaches A = 64 at n = 8: boundary at the 9th step of each interval
    ({"auto_max_interval": 5}, [4, 9, 14, 19, 24, 29]),
    ({"auto_min_interval": 12}, [11, 23]),
])
def test_optimizer_auto_interval_fires_where_the_rule_says(bounds: dict, expected: list[int]) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(COLS, ROWS)
    cfg = zen(topk_ratio=0.125, update_interval="auto", overlap_step=False, **bounds)
    with ZenFlowOptimizer(layer.named_parameters(), cfg, lr=1e-3, max_grad_norm=1.0) as opt:
        stats = []
        for t in range(30):
            constant_grads(layer, t)
            stats.append(opt.step())
        assert opt.device_state.index[0].tolist() == LOUD
    assert [s.step for s in stats if s.boundary] == expected
    lengths = [b - a for a, b in zip([-1, *expected], expected)]
    assert [s.update_interval for s in stats if s.boundary] == lengths
