"""Resuming on another number of processes: the global batch is kept or the resume is refused,
and host state pieces keyed by name and column range are re-cut exactly (no processes needed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from zfctl.errors import UserError
from zfctl.offload.layout import plan_layout
from zfctl.offload.parallel.partition import partition_layout
from zfctl.offload.parallel.pieces import gather_host, merge_states, owned_ranges, owners, split_host
from zfctl.plan import resolve_plan
from zfctl.train.world_size import as_saved_world, fit_world_size


def plan(accum: int, nproc: int = 1):
    p = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.micro_batch_size=2"])
    return replace(p, train=replace(p.train, gradient_accumulation_steps=accum),
                   distributed=replace(p.distributed, nproc=nproc))


def test_accumulation_absorbs_the_world_size_change_or_the_resume_is_refused():
    same, note = fit_world_size(plan(3, 2), 2, 2)
    assert same == plan(3, 2) and note is None
    fitted, note = fit_world_size(plan(3, 2), 2, 3)  # 6 micro-batches per step: 2 on each of 3
    assert fitted.train.gradient_accumulation_steps == 2 and fitted.distributed.nproc == 3
    assert note == ("resuming on 3 process(es), saved on 2: train.gradient_accumulation_steps 3 -> 2 keeps the "
                    "global batch of 12 sequences")
    with pytest.raises(UserError) as e:
        fit_world_size(plan(3, 2), 2, 4)
    assert str(e.value) == (
        "cannot resume on 4 process(es): the run's global batch is 12 sequences (train.micro_batch_size 2 x "
        "train.gradient_accumulation_steps 3 x 2 process(es)), and its 6 micro-batches per step cannot be "
        "shared by 4; resume with --nproc 1 / 2 / 3 / 6")


def test_a_plan_yaml_rewritten_by_an_earlier_resume_is_not_an_edit():
    saved = plan(1, 2)  # the checkpoint's plan: 2 processes
    rewritten = plan(2, 1)  # plan.yaml after a resume on 1 process
    assert as_saved_world(rewritten, saved) == saved
    edited = replace(rewritten, train=replace(rewritten.train, lr=1e-5))
    assert as_saved_world(edited, saved).train.lr == 1e-5  # a real edit still shows
    odd = plan(3, 1)  # 3 micro-batches cannot be 2 processes' worth: left as is, reported as a change
    assert as_saved_world(odd, saved) == odd


def _layout(world: int, rank: int, by_row: frozenset[str] = frozenset()):
    torch.manual_seed(0)
    named = [("a", torch.zeros(5, 7)), ("bias", torch.zeros(5)), ("b", torch.zeros(3, 11)), ("c", torch.zeros(4, 2))]
    full = plan_layout(named, 0.25, by_row)
    return full if world == 1 else partition_layout(full, None, rank, world)[0]


@pytest.mark.parametrize("by_row", [frozenset(), frozenset({"b"})], ids=["columns", "b-by-row"])
@pytest.mark.parametrize(("saved", "new"), [(3, 1), (1, 2), (2, 3), (3, 2)])
def test_pieces_saved_by_any_world_size_assemble_any_other_cut(saved: int, new: int, by_row: frozenset[str]):
    """(b by row: its 3 rows are the columns, so its pieces are row ranges; the same machinery.)"""
    full = _layout(1, 0, by_row)
    ref = {"master": torch.arange(full.host_numel, dtype=torch.float32),
           "exp_avg": -torch.arange(full.host_numel, dtype=torch.float32),
           "steps": torch.arange(full.host_cols, dtype=torch.float32) * 10}
    states = []
    for r in range(saved):  # each saved rank's flat buffers, cut from the reference
        lay = _layout(saved, r, by_row)
        mine = gather_host(lay, split_host(full, ref))
        states.append({"host": split_host(lay, mine),
                       "partition": {"ranges": [[n, r, a, b] for n, a, b in owned_ranges(lay)]}})
    ranges = [rg for st in states for rg in st["partition"]["ranges"]]
    back = []
    for r in range(new):
        lay = _layout(new, r, by_row)
        need = owners(ranges, owned_ranges(lay))
        got = gather_host(lay, merge_states([states[o] for o in need], owned_ranges(lay))["host"])
        assert all(torch.equal(got[k], gather_host(lay, split_host(full, ref))[k]) for k in ref)
        back.append(split_host(lay, got))
    whole = gather_host(full, [p for pieces in back for p in pieces])  # the cuts tile the matrices
    assert all(torch.equal(whole[k], ref[k]) for k in ref)


def test_a_missing_column_range_is_named():
    lay = _layout(2, 1)
    pieces = split_host(_layout(2, 0), gather_host(_layout(2, 0), split_host(_layout(1, 0), {
        "master": torch.zeros(_layout(1, 0).host_numel)})))
    with pytest.raises(ValueError, match=r"lacks columns of '.*': this process holds \[\d+, \d+\)"):
        gather_host(lay, pieces)
