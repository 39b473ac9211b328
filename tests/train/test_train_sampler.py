"""The resumable sampler and the LR schedules: pure functions of (seed, position) and step."""

from __future__ import annotations

import math
from itertools import chain

import pytest
import torch

from zfctl.train.data.sampler import ResumableSampler, SamplerPosition
from zfctl.train.schedule import build_scheduler, lr_multiplier, restore_scheduler


def _take(s: ResumableSampler, n: int) -> list[list[int]]:
    return [s.next_indices() for _ in range(n)]


def test_every_epoch_is_a_permutation_and_epochs_differ():
    s = ResumableSampler(10, 3, seed=7)
    assert s.batches_per_epoch() == 4  # 3+3+3+1: one process keeps the short last batch
    e0, e1 = _take(s, 4), _take(s, 4)
    assert [len(b) for b in e0] == [3, 3, 3, 1]
    assert sorted(chain(*e0)) == list(range(10)) == sorted(chain(*e1))
    assert list(chain(*e0)) != list(chain(*e1))
    assert s.position == SamplerPosition(1, 10)


def test_restore_is_exact_without_replay():
    straight = ResumableSampler(23, 4, seed=3)
    batches = _take(straight, 17)  # crosses two epoch boundaries
    first = ResumableSampler(23, 4, seed=3)
    _take(first, 9)
    pos = SamplerPosition.from_dict(first.position.to_dict())
    resumed = ResumableSampler(23, 4, seed=3, position=pos)
    assert batches[:9] + _take(resumed, 8) == batches


def test_seed_changes_order_and_global_rng_untouched():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = _take(ResumableSampler(50, 5, seed=1), 3)
    b = _take(ResumableSampler(50, 5, seed=2), 3)
    assert a != b
    assert torch.equal(before, torch.get_rng_state())


def test_ranks_partition_each_global_batch_and_drop_incomplete():
    ranks = [ResumableSampler(11, 2, seed=5, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].batches_per_epoch() == 2  # 11 // 4; the last 3 samples are dropped
    seen = []
    for _ in range(2):
        parts = [s.next_indices() for s in ranks]
        assert [len(p) for p in parts] == [2, 2]
        assert not set(parts[0]) & set(parts[1])
        seen += parts[0] + parts[1]
    assert len(set(seen)) == 8
    # The global order is the one a single process with a 4-sample batch would see.
    single = ResumableSampler(11, 4, seed=5)
    assert seen == single.next_indices() + single.next_indices()


def test_too_few_samples_is_an_error():
    with pytest.raises(ValueError, match="cannot fill one global micro-batch"):
        ResumableSampler(3, 2, seed=0, world_size=2)


def test_schedules_values():
    cos = lr_multiplier("cosine", warmup_steps=2, total_steps=10)
    assert [cos(0), cos(1), cos(2)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert cos(6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(10) == pytest.approx(0.0)
    lin = lr_multiplier("linear", warmup_steps=0, total_steps=4)
    assert [lin(s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    const = lr_multiplier("constant", warmup_steps=1, total_steps=4)
    assert [const(s) for s in range(4)] == pytest.approx([0.5, 1, 1, 1])
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_multiplier("step", 0, 1)


def test_scheduler_restore_reapplies_lr_to_groups():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = build_scheduler(opt, "cosine", warmup_steps=1, total_steps=8)
    for _ in range(5):
        opt.step()
        sched.step()
    state, lr = sched.state_dict(), opt.param_groups[0]["lr"]
    opt2 = torch.optim.SGD([p], lr=0.1)  # a fresh optimizer, groups at the base LR
    sched2 = build_scheduler(opt2, "cosine", warmup_steps=1, total_steps=8)
    restore_scheduler(sched2, state)
    assert opt2.param_groups[0]["lr"] == lr  # bit-equal, not approx
    opt.step(); sched.step(); opt2.step(); sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_scheduler_restore_takes_the_new_peak_lr_and_length():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = build_scheduler(opt, "linear", warmup_steps=0, total_steps=10)
    for _ in range(4):
        opt.step()
        sched.step()
    opt2 = torch.optim.SGD([p], lr=0.2)  # resumed with a changed peak LR and a longer run
    sched2 = build_scheduler(opt2, "linear", warmup_steps=0, total_steps=20)
    restore_scheduler(sched2, sched.state_dict())
    assert sched2.last_epoch == 4
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.2 * (1 - 4 / 20))
    assert sched2.get_last_lr() == [opt2.param_groups[0]["lr"]]
