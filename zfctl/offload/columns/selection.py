"""Which columns the device owns, and how their optimizer state follows them when that changes.

Importance of a column is the L1 norm of its gradient in the step where selection happens (the
gradient after clipping/unscaling differs only by one positive factor, which does not change the
ranking, so the raw gradient is scored). Each matrix keeps its top ``k`` columns, ``k`` fixed by
``layout.num_selected``. Indices are kept sorted so that the device block's row order, the
state_dict and every run list are deterministic.

State follows the column. A column's state is its fp32 master value, its two moments and its
step counter (how many Adam updates its moments have absorbed; see ``device_adam``). Entering
columns take all four from the host; leaving columns write all four back to the host; columns
that stay keep their device state untouched. Nothing is reset or re-derived from the bf16 model
weights, so a column that leaves and re-enters continues exactly where it was.

``plan_moves`` turns the old and new column ids (host copies) into what moves where; one process
and FSDP2 ranks execute it by asynchronous DMA (migration.py), data-parallel ranks through the
blocking ``migrate`` below, with ``partition.OwnedRows`` for the host rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from zfctl.offload.layout import DeviceBlock, Layout, ParamSlot, column_runs


class ColumnState(NamedTuple):
    """Views of one matrix's state, row i = column i: master/exp_avg/exp_avg_sq [n, rows], steps [n]."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: torch.Tensor


class HostRows(Protocol):
    """What ``migrate`` needs of one host state tensor: rows addressed by column id. A tensor (the
    whole owned range), or ``partition.OwnedRows`` when this rank holds only some of the rows."""

    def index_select(self, dim: int, index: torch.Tensor, /) -> torch.Tensor: ...

    def index_copy_(self, dim: int, index: torch.Tensor, source: torch.Tensor, /) -> object: ...


def column_l1(grad_matrix: torch.Tensor) -> torch.Tensor:
    """Per-column L1 norm (fp32, accumulated in fp32) of a ``[rows, cols]`` gradient: one reduction."""
    return torch.linalg.vector_norm(grad_matrix, ord=1, dim=0, dtype=torch.float32)


def top_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 indices of the ``k`` highest scores (ties resolved by torch.topk, deterministic)."""
    return torch.topk(scores, k, sorted=False).indices.sort().values


def stay_share(olds: Sequence[torch.Tensor | None], news: Sequence[torch.Tensor],
               cols: Sequence[int]) -> float | None:
    """The share of the device's columns that stay at a selection: staying / previously selected
    columns, over every matrix (each column counts once), from per-matrix sorted host int64 ids
    ``olds`` (None: no selection yet) and ``news``; ``cols``: each matrix's column count. None at
    the first selection. The ids are made global (offset by the columns of the matrices before)
    so that one ``isin`` answers every matrix: a fixed number of ops, none per matrix or column."""
    have = [i for i, o in enumerate(olds) if o is not None]
    if not have:
        return None
    starts = torch.tensor([0, *cols[:-1]], dtype=torch.int64).cumsum(0)[have]

    def glob(ids: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(ids) + starts.repeat_interleave(torch.tensor([c.numel() for c in ids]))

    old = glob([o for o in olds if o is not None])
    new = glob([news[i] for i in have])
    return int(torch.isin(new, old, assume_unique=True).sum()) / max(old.numel(), 1)


@dataclass(frozen=True)
class Moves:
    """How one matrix's device columns change (host int64 ids; positions are device rows)."""

    slot: ParamSlot
    leave_pos: torch.Tensor  # old device rows of the leaving columns
    leave_cols: torch.Tensor  # their column ids (host rows)
    stay_src: torch.Tensor  # staying columns that change rows: old row ...
    stay_dst: torch.Tensor  # ... and new row
    enter_dst: torch.Tensor  # new device rows of the entering columns
    enter_cols: torch.Tensor  # their column ids (host rows)

    @property
    def changed(self) -> bool:
        return bool(self.enter_dst.numel() or self.stay_src.numel())


def plan_moves(slot: ParamSlot, old: torch.Tensor | None, new: torch.Tensor) -> Moves:
    """The moves from sorted column ids ``old`` (None: none yet) to ``new`` (host tensors)."""
    old = old if old is not None else torch.empty(0, dtype=torch.int64)
    stays = torch.isin(new, old)
    leaving = ~torch.isin(old, new)
    src = torch.searchsorted(old, new[stays])
    dst = torch.nonzero(stays).flatten()
    moved = src != dst  # a column that keeps its row needs no copy
    return Moves(slot, torch.nonzero(leaving).flatten(), old[leaving], src[moved], dst[moved],
                 torch.nonzero(~stays).flatten(), new[~stays])


@dataclass(frozen=True)
class BlockMoves:
    """One device block's moves (layout.py DeviceBlock): its selectable matrices' Moves, in
    device-column order, concatenated; positions are block rows (device column - block.col0)."""

    block: DeviceBlock
    moves: tuple[Moves, ...]
    leave_pos: torch.Tensor
    stay_src: torch.Tensor
    stay_dst: torch.Tensor
    enter_dst: torch.Tensor
    leave_n: tuple[int, ...]
    stay_n: tuple[int, ...]
    enter_n: tuple[int, ...]


@dataclass(frozen=True)
class SelectionPlan:
    moves: list[Moves]
    blocks: list[BlockMoves]
    entering_runs: torch.Tensor
    owned: torch.Tensor


def plan_selection(layout: Layout, slots: Sequence[ParamSlot], olds: Sequence[torch.Tensor | None],
                   news: Sequence[torch.Tensor]) -> SelectionPlan:
    """TEMPORARY per-matrix reference (replaced by the bulk version)."""
    moves = [plan_moves(s, o, n) for s, o, n in zip(slots, olds, news)]
    blocks = []
    for b in layout.blocks:
        ms = sorted((m for m in moves if b.col0 <= m.slot.dev_col0 < b.col0 + b.ncols and m.slot.rows == b.length),
                    key=lambda m: m.slot.dev_col0)
        if not ms:
            continue
        off = [m.slot.dev_col0 - b.col0 for m in ms]
        cat = lambda n: torch.cat([getattr(m, n) + o for m, o in zip(ms, off)])
        blocks.append(BlockMoves(b, tuple(ms), cat("leave_pos"), cat("stay_src"), cat("stay_dst"), cat("enter_dst"),
                                 tuple(m.leave_pos.numel() for m in ms), tuple(m.stay_src.numel() for m in ms),
                                 tuple(m.enter_dst.numel() for m in ms)))
    mask = torch.zeros(layout.host_cols, dtype=torch.bool)
    owned = torch.zeros(layout.host_cols, dtype=torch.bool)
    for m, n in zip(moves, news):
        s = m.slot
        c = m.enter_cols[(m.enter_cols >= s.host_c0) & (m.enter_cols < s.host_c1)]
        mask[s.host_col0 + c - s.host_c0] = True
        c = n[(n >= s.host_c0) & (n < s.host_c1)]
        owned[s.host_col0 + c - s.host_c0] = True
    return SelectionPlan(moves, blocks, column_runs(mask, layout.host_col_offsets), torch.nonzero(owned).flatten())


def migrate(dev: ColumnState, host: Sequence[HostRows], old: torch.Tensor | None,
            new: torch.Tensor) -> tuple[int, int]:
    """Move state so that ``dev`` rows hold the columns ``new`` (sorted), previously ``old``:
    data parallel, where ``host`` is ``partition.OwnedRows`` (one process and FSDP2 ranks migrate
    asynchronously instead: migration.py).

    ``host``: the same four states in ``ColumnState`` order, rows indexed by column id (the whole
    owned range). Returns (d2h_bytes, h2d_bytes). Cost: two tiny index copies to the host (a
    device sync; selection steps only), a blocking D2H per state tensor for the leaving columns
    and an H2D for the entering ones.
    """
    device = dev.master.device
    new_h = new.to("cpu")
    old_h = old.to("cpu") if old is not None else torch.empty(0, dtype=torch.int64)
    stays = torch.isin(new_h, old_h)
    leaving = ~torch.isin(old_h, new_h)
    d2h = h2d = 0

    # Leaving columns: device -> host (PCIe D2H of master, moments and counters of those columns).
    if leaving.any():
        pos = torch.nonzero(leaving).flatten().to(device)
        cols = old_h[leaving]
        for d, h in zip(dev, host):
            moved = d.index_select(0, pos).to("cpu")
            h.index_copy_(0, cols, moved)
            d2h += moved.numel() * moved.element_size()

    # New device rows: staying columns move inside the device block, entering ones come from the host.
    stay_src = torch.searchsorted(old_h, new_h[stays]).to(device)
    stay_dst = torch.nonzero(stays).flatten().to(device)
    enter_dst = torch.nonzero(~stays).flatten().to(device)
    enter_cols = new_h[~stays]
    for d, h in zip(dev, host):
        staying = d.index_select(0, stay_src)  # gathered before d is overwritten
        d.index_copy_(0, stay_dst, staying)
        entering = h.index_select(0, enter_cols).to(device)  # PCIe H2D
        h2d += entering.numel() * entering.element_size()
        d.index_copy_(0, enter_dst, entering)
    return d2h, h2d
