"""A selection planned in bulk (columns/selection.py ``plan_selection``, cpu/host.py
``HostState.set_owned``) gives exactly what the per-matrix code gives (``plan_moves``, a mask per
matrix and ``column_runs``, ``HostState.set_device_owned``), bit for bit, for whole and partitioned
(data-parallel) host ranges, in a number of torch ops that does not grow with the matrices; and
the chunks planned from one run list (device/chunks.py ``plan_chunks``) are those planned chunk
by chunk.

Layouts are planned on meta tensors (no state), small: each test takes well under a second.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zfctl.offload.columns.selection import Moves, SelectionPlan, plan_moves, plan_selection
from zfctl.offload.cpu.host import HostState
from zfctl.offload.device.chunks import Chunk, plan_chunks
from zfctl.offload.layout import Layout, ParamSlot, column_runs, plan_layout
from zfctl.offload.parallel.partition import partition_layout

FIELDS = ("leave_pos", "leave_cols", "stay_src", "stay_dst", "enter_dst", "enter_cols")
STAYS = (None, 0.0, 0.1, 0.5, 0.9, 1.0)  # None: the first selection (nothing old)


def _layout(layers: int, topk: float, seed: int = 0) -> Layout:
    """A Llama-like mix: a by-row embedding, per layer q/k/v/o/up/down (several matrices per column
    length, so blocks hold several), a 3-D weight, a norm (dense) and a one-column matrix (fixed)."""
    g = torch.Generator().manual_seed(seed)
    h, f, v = 16, 24 + 8 * int(torch.randint(0, 2, (1,), generator=g)), 50
    shapes: list[tuple[str, tuple[int, ...]]] = [("emb", (v, h))]
    for i in range(layers):
        shapes += [(f"{i}.q", (h, h)), (f"{i}.k", (8, h)), (f"{i}.v", (8, h)), (f"{i}.o", (h, h)),
                   (f"{i}.norm", (h,)), (f"{i}.up", (f, h)), (f"{i}.down", (h, f))]
    shapes += [("conv", (4, 3, 5)), ("one", (3, 1)), ("head", (v, h))]
    named = [(n, torch.empty(s, device="meta")) for n, s in shapes]
    return plan_layout(named, topk, frozenset({"emb"}))


def _sets(slots: list[ParamSlot], stay: float | None, seed: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """Sorted old and new column sets of ``k`` each with ``round(stay * k)`` staying (as many as the
    matrix has room for); ``stay`` None: no old sets."""
    g = torch.Generator().manual_seed(seed)
    olds: list[torch.Tensor | None] = []
    news = []
    for s in slots:
        perm = torch.randperm(s.cols, generator=g)
        k = s.k
        kept = max(round((stay or 0.0) * k), 2 * k - s.cols)  # room for k - kept newcomers
        olds.append(perm[:k].sort().values if stay is not None else None)
        news.append(torch.cat([perm[:kept], perm[k : 2 * k - kept]]).sort().values)
    return olds, news


def _ref_mask(layout: Layout, slots: list[ParamSlot], ids: list[torch.Tensor]) -> torch.Tensor:
    """The per-matrix reference: True at every id of ``ids`` inside its slot's owned host range."""
    mask = torch.zeros(layout.host_cols, dtype=torch.bool)
    for s, c in zip(slots, ids):
        c = c[(c >= s.host_c0) & (c < s.host_c1)]
        mask[s.host_col0 + c - s.host_c0] = True
    return mask


def _check(layout: Layout, slots: list[ParamSlot], olds: list[torch.Tensor | None], news: list[torch.Tensor]) -> SelectionPlan:
    plan = plan_selection(layout, slots, olds, news)
    ref = [plan_moves(s, o, n) for s, o, n in zip(slots, olds, news)]
    assert len(plan.moves) == len(ref)
    for a, b in zip(plan.moves, ref):
        assert a.slot is b.slot
        for f in FIELDS:
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y), (a.slot.name, f)
    _check_blocks(layout, plan)
    entering = _ref_mask(layout, slots, [m.enter_cols for m in ref])
    assert torch.equal(plan.entering_runs, column_runs(entering, layout.host_col_offsets))
    assert torch.equal(plan.owned, torch.nonzero(_ref_mask(layout, slots, news)).flatten())
    return plan


def _check_blocks(layout: Layout, plan: SelectionPlan) -> None:
    """Each block's arrays: its matrices' (device column order) in block rows, concatenated."""
    def inside(s: ParamSlot, b: Any) -> bool:
        return not b.fixed and b.col0 <= s.dev_col0 < b.col0 + b.ncols

    want = [b for b in layout.blocks if any(inside(m.slot, b) for m in plan.moves)]
    assert [bm.block for bm in plan.blocks] == want
    for bm in plan.blocks:
        ms = sorted((m for m in plan.moves if inside(m.slot, bm.block)), key=lambda m: m.slot.dev_col0)
        assert len(bm.moves) == len(ms) and all(a is b for a, b in zip(bm.moves, ms))

        def cat(f: str, ms: list[Moves] = ms, col0: int = bm.block.col0) -> torch.Tensor:
            return torch.cat([getattr(m, f) + (m.slot.dev_col0 - col0) for m in ms])

        for f in ("leave_pos", "stay_src", "stay_dst", "enter_dst"):
            assert torch.equal(getattr(bm, f), cat(f)), f
        assert bm.leave_n == tuple(m.leave_cols.numel() for m in ms)
        assert bm.stay_n == tuple(m.stay_src.numel() for m in ms)
        assert bm.enter_n == tuple(m.enter_cols.numel() for m in ms)


def _slow_runs(mask: torch.Tensor, offsets: torch.Tensor) -> list[list[int]]:
    runs: list[list[int]] = []
    for c, on in enumerate(mask.tolist()):
        if on and runs and runs[-1][0] + runs[-1][1] == int(offsets[c]):
            runs[-1][1] += int(offsets[c + 1] - offsets[c])
        elif on:
            runs.append([int(offsets[c]), int(offsets[c + 1] - offsets[c])])
    return runs


def test_column_runs_is_the_stretches_of_the_mask() -> None:
    """The reference below leans on ``column_runs``: it matches a column-by-column loop."""
    g = torch.Generator().manual_seed(3)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randint(1, 5, (60,), generator=g).cumsum(0)])
    for p in (0.0, 0.1, 0.5, 0.9, 1.0):
        mask = torch.rand(60, generator=g) < p
        assert column_runs(mask, offsets).tolist() == _slow_runs(mask, offsets)


@pytest.mark.parametrize("topk", [0.1, 0.4])
@pytest.mark.parametrize("stay", STAYS)
def test_plan_selection_equals_the_per_matrix_plan(topk: float, stay: float | None) -> None:
    layout = _layout(3, topk)
    slots = [s for s in layout.slots if s.selects]
    assert len({s.rows for s in slots}) < len(slots)  # blocks of several matrices
    olds, news = _sets(slots, stay, seed=int(10 * (stay or 0)))
    plan = _check(layout, slots, olds, news)
    if stay == 1.0:  # nothing changes: no moves, no entering runs
        assert not any(m.changed for m in plan.moves) and plan.entering_runs.shape == (0, 2)


def test_plan_selection_in_any_slot_order_and_with_some_matrices_new() -> None:
    """The moves come back in the order given; a matrix without old columns only enters."""
    layout = _layout(2, 0.4, seed=1)
    slots = [s for s in layout.slots if s.selects][::-1]
    olds, news = _sets(slots, 0.5, seed=5)
    olds[1] = olds[4] = None
    _check(layout, slots, olds, news)


@pytest.mark.parametrize("world", [2, 3])
def test_partitioned_ranges_plan_only_their_own_columns(world: int) -> None:
    """Data parallel (partition.py ``partition_layout``): a rank's slots own sub-ranges of their
    columns, some none; the moves are the whole matrix's, the entering runs and the owned columns
    this rank's only, and ``set_owned`` marks what ``set_device_owned`` per matrix marks."""
    full = _layout(2, 0.4, seed=2)
    olds, news = _sets([s for s in full.slots if s.selects], 0.5, seed=7)
    split = 0
    for rank in range(world):
        layout, _ = partition_layout(full, None, rank, world)
        slots = [s for s in layout.slots if s.selects]
        split += sum(0 < s.host_c1 - s.host_c0 < s.cols for s in slots)
        plan = _check(layout, slots, olds, news)
        before = torch.rand(layout.host_cols, generator=torch.Generator().manual_seed(rank)) < 0.5
        ref: Any = SimpleNamespace(device_owned=before.clone())
        ref._owned = lambda s, ref=ref: HostState._owned(ref, s)
        for s, n in zip(slots, news):
            HostState.set_device_owned(ref, s, n)
        got: Any = SimpleNamespace(device_owned=before.clone())
        HostState.set_owned(got, plan.owned)
        assert torch.equal(got.device_owned, ref.device_owned)
    assert split  # some matrix is cut between ranks


class _Ops(TorchDispatchMode):
    """Aten ops run, views (metadata only, e.g. a ``split``'s pieces) left out."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


def test_plan_selection_runs_a_fixed_number_of_ops() -> None:
    """9 or 63 selectable matrices, first selection or not: the same op count, none per matrix."""
    counts = []
    for layers in (1, 10):
        layout = _layout(layers, 0.4)
        slots = [s for s in layout.slots if s.selects]
        for stay in (None, 0.5):
            olds, news = _sets(slots, stay, seed=1)
            ops = _Ops()
            with ops:
                plan_selection(layout, slots, olds, news)
            counts.append((len(slots), ops.n))
    assert [m for m, _ in counts] == [9, 9, 63, 63]
    assert len({n for _, n in counts}) == 1 and counts[0][1] <= 100, counts


def _chunks_one_by_one(layout: Layout, device_owned: torch.Tensor, slot_bytes: int, itemsize: int) -> list[Chunk]:
    """The reference: ``plan_chunks`` as it was, chunk by chunk (``all``, ``any`` and
    ``column_runs`` of each chunk's columns)."""
    chunks = []
    for slot in layout.host_slots:
        per = max(1, slot_bytes // (slot.rows * itemsize))
        for c0 in range(slot.host_c0, slot.host_c1, per):
            c1 = min(c0 + per, slot.host_c1)
            g0 = slot.host_col0 + c0 - slot.host_c0
            g1 = g0 + c1 - c0
            owned = device_owned[g0:g1]
            if bool(owned.all()):
                continue
            off = int(layout.host_col_offsets[g0])
            runs = None
            if bool(owned.any()):
                runs = column_runs(~owned, layout.host_col_offsets[g0 : g1 + 1] - off)
            chunks.append(Chunk(slot, c0, c1, off, runs))
    return chunks


def _masks(layout: Layout) -> list[torch.Tensor]:
    """All host-owned, all device-owned, random ones, one matrix wholly device-owned."""
    g = torch.Generator().manual_seed(4)
    n = layout.host_cols
    one = torch.rand(n, generator=g) < 0.3
    s = layout.host_slots[1]
    one[s.host_col0 : s.host_col0 + s.host_c1 - s.host_c0] = True
    return [torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool), one,
            *(torch.rand(n, generator=g) < p for p in (0.1, 0.5, 0.9))]


@pytest.mark.parametrize("world", [1, 3])
def test_plan_chunks_equals_the_chunk_by_chunk_plan(world: int) -> None:
    """Slots of one column per chunk up to a whole matrix per chunk; runs that cross chunk and
    matrix edges are cut there; partitioned ranges too."""
    full = _layout(2, 0.1)
    for rank in range(world):
        layout = partition_layout(full, None, rank, world)[0] if world > 1 else full
        for mask in _masks(layout):
            for slot_bytes in (1, 40, 200, 1000, 2**20):
                got = plan_chunks(layout, mask, slot_bytes, 2)
                want = _chunks_one_by_one(layout, mask, slot_bytes, 2)
                assert [(c.slot, c.c0, c.c1, c.off) for c in got] == [(c.slot, c.c0, c.c1, c.off) for c in want]
                for a, b in zip(got, want):
                    assert (a.runs is None) == (b.runs is None)
                    assert a.runs is None or (b.runs is not None and torch.equal(a.runs, b.runs))
