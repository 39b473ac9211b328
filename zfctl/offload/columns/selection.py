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
blocking ``migrate`` below, with ``partition.OwnedRows`` for the host rows. ``plan_selection``
plans every matrix at once (the same moves, plus each device block's moves, the entering
columns' host runs and the new device-owned columns) in a fixed number of vectorised ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from zfctl.offload.layout import DeviceBlock, Layout, ParamSlot


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


def stay_share(moves: Sequence[Moves]) -> float | None:
    """The share of the device's columns that stay at a selection: staying / previously selected
    columns, over every matrix (each column once), from the selection's moves (``plan_selection``):
    a matrix's old columns are its staying ones (``k`` less the entering) and its leaving ones; one
    with no selection yet has neither. None at the first selection. Arithmetic on the counts the
    plan has, no torch op: the stays were found once, by the plan."""
    stay = [m.slot.k - m.enter_cols.numel() for m in moves]
    old = sum(stay) + sum(m.leave_cols.numel() for m in moves)
    return sum(stay) / old if old else None


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


@dataclass(frozen=True)
class BlockMoves:
    """One device block's moves (layout.py ``DeviceBlock``): its selectable matrices' Moves, in
    device-column order, concatenated; positions are block rows (device column - block.col0)."""

    block: DeviceBlock
    moves: tuple[Moves, ...]  # the matrices of this block, device-column order (SelectionPlan.moves' objects)
    leave_pos: torch.Tensor  # int64, block rows of every leaving column (matrix by matrix, each sorted)
    stay_src: torch.Tensor  # staying columns that change rows: old block row ...
    stay_dst: torch.Tensor  # ... and new block row
    enter_dst: torch.Tensor  # block rows of the entering columns
    leave_n: tuple[int, ...]  # per matrix (as ``moves``): how many of leave_pos are its
    stay_n: tuple[int, ...]  # per matrix: its share of stay_src/stay_dst
    enter_n: tuple[int, ...]  # per matrix: its share of enter_dst


@dataclass(frozen=True)
class SelectionPlan:
    """A whole selection's plan (``plan_selection``)."""

    moves: list[Moves]  # per selectable matrix, in the order given: tensor-equal to plan_moves
    blocks: list[BlockMoves]  # per device block holding selectable columns, in layout.blocks order
    # (offset, length) int64 [n, 2] flat host element runs of every entering column inside its
    # matrix's owned range [slot.host_c0, slot.host_c1): the worker's priority request
    entering_runs: torch.Tensor
    # sorted int64 flat host column ids (slot.host_col0 + c - slot.host_c0) of the new selection
    # inside the owned ranges: where HostState.device_owned is True (``HostState.set_owned``)
    owned: torch.Tensor


def plan_selection(layout: Layout, slots: Sequence[ParamSlot], olds: Sequence[torch.Tensor | None],
                   news: Sequence[torch.Tensor]) -> SelectionPlan:
    """``plan_moves`` of every matrix of ``slots`` (the selectable ones) from sorted host int64
    column ids ``olds`` (None: none yet) to ``news``, and with them each device block's moves in
    block rows, the flat host element runs of the entering columns inside each slot's owned range
    ``[host_c0, host_c1)`` (the worker's priority request) and the new device-owned host columns
    there (``HostState.set_owned``).

    Cost: a fixed number of torch ops over all matrices at once (~90, none per matrix or column:
    tests/offload/test_selection_plan.py counts them), O(selected + selectable columns): ~3 ms on
    one thread at a 1B model's shapes (113 matrices, 456k columns, 45k selected), where
    ``plan_moves`` per matrix, a mask per matrix and ``column_runs`` took ~14 ms. Temporaries: 5 B
    per selectable column (an int32 map and a bool mask). Column ids are made global, each
    matrix's offset by the columns of the matrices before it in device column order, so that one
    map of old positions and one mask of new ids over that space answer "stays" and "leaves" for
    every matrix, and each block's matrices (consecutive device columns, layout.py
    ``plan_layout``) are a stretch of the global arrays. The per-matrix and per-block tensors are
    ``split`` views of those arrays (read them; do not write them in place). Host ids are put in
    host column order by one permutation, where the owned ones come out sorted and the entering
    ones' runs are the breaks in that sequence.
    """
    n, i64 = len(slots), torch.int64
    if n == 0:
        return SelectionPlan([], [], torch.empty(0, 2, dtype=i64), torch.empty(0, dtype=i64))
    order = sorted(range(n), key=lambda i: slots[i].dev_col0)  # device column order
    dslots = [slots[i] for i in order]
    none = torch.empty(0, dtype=i64)
    dold = [o if (o := olds[i]) is not None else none for i in order]
    dnew = [news[i] for i in order]
    ko, kn = [o.numel() for o in dold], [c.numel() for c in dnew]
    owner = _owners(layout, dslots)
    # Per matrix (device order): global id base, first old position, first new position, block
    # row of its device row 0, host flat id of its column 0 (host_col0 - host_c0), owned range
    # [host_c0, host_c1). One small tensor; each id finds its matrix's by ``m_old`` / ``m_new``.
    info, base, o0, n0 = [], 0, 0, 0
    for j, s in enumerate(dslots):
        info.append((base, o0, n0, s.dev_col0 - layout.blocks[owner[j]].col0, s.host_col0 - s.host_c0,
                     s.host_c0, s.host_c1))
        base, o0, n0 = base + s.cols, o0 + ko[j], n0 + kn[j]
    t_base, t_o0, t_n0, t_brow, t_hoff, t_hc0, t_hc1 = torch.tensor(info, dtype=i64).t().contiguous()
    m_old = torch.arange(n).repeat_interleave(torch.tensor(ko))  # each old id's matrix
    m_new = torch.arange(n).repeat_interleave(torch.tensor(kn))
    col_old, col_new = torch.cat(dold), torch.cat(dnew)
    g_old = col_old + t_base.index_select(0, m_old)
    g_new = col_new + t_base.index_select(0, m_new)

    # Old position of every global id (-1: not old), and which global ids are new: one mask each
    # way over the selectable columns (cheaper than ``isin``'s sort).
    where = torch.full((base,), -1, dtype=torch.int32)  # int32: half the bytes to fill
    where.index_put_((g_old,), torch.arange(o0, dtype=torch.int32))
    src_all = where.index_select(0, g_new)
    stays = src_all >= 0
    is_new = torch.zeros(base, dtype=torch.bool).index_fill_(0, g_new, True)

    lp = torch.nonzero(~is_new.index_select(0, g_old)).flatten()  # leaving: global old positions
    ml = m_old.index_select(0, lp)
    leave_pos = lp - t_o0.index_select(0, ml)
    leave_cols = col_old.index_select(0, lp)
    sp = torch.nonzero(stays).flatten()  # staying: global new positions
    ms = m_new.index_select(0, sp)
    src, dst = src_all.index_select(0, sp) - t_o0.index_select(0, ms), sp - t_n0.index_select(0, ms)
    moved = torch.nonzero(src != dst).flatten()  # a column that keeps its row needs no copy
    ms, src, dst = ms.index_select(0, moved), src.index_select(0, moved), dst.index_select(0, moved)
    ep = torch.nonzero(~stays).flatten()  # entering: global new positions
    me = m_new.index_select(0, ep)
    enter_dst = ep - t_n0.index_select(0, me)
    enter_cols = col_new.index_select(0, ep)
    counts = torch.bincount(torch.cat([ml, ms + n, me + 2 * n]), minlength=3 * n).tolist()
    ln, sn, en = counts[:n], counts[n : 2 * n], counts[2 * n :]

    parts = [x.split(c) for x, c in ((leave_pos, ln), (leave_cols, ln), (src, sn), (dst, sn),
                                     (enter_dst, en), (enter_cols, en))]
    dmoves = [Moves(s, *(p[j] for p in parts)) for j, s in enumerate(dslots)]
    moves: list[Moves] = [dmoves[0]] * n
    for j, i in enumerate(order):
        moves[i] = dmoves[j]

    # Blocks: consecutive matrices of the device order, so consecutive stretches of the arrays.
    groups: list[list[int]] = []  # matrices (device order) per block holding any
    for j, b in enumerate(owner):
        if j == 0 or b != owner[j - 1]:
            groups.append([])
        groups[-1].append(j)

    def per_block(x: torch.Tensor, m: torch.Tensor, c: list[int]) -> tuple[torch.Tensor, ...]:
        return (x + t_brow.index_select(0, m)).split([sum(c[j] for j in g) for g in groups])

    bl, be = per_block(leave_pos, ml, ln), per_block(enter_dst, me, en)
    bs, bd = per_block(src, ms, sn), per_block(dst, ms, sn)
    blocks = [BlockMoves(layout.blocks[owner[g[0]]], tuple(dmoves[j] for j in g), bl[x], bs[x], bd[x], be[x],
                         tuple(ln[j] for j in g), tuple(sn[j] for j in g), tuple(en[j] for j in g))
              for x, g in enumerate(groups)]
    owned, ent = _host_ids(dslots, kn, (t_hoff, t_hc0, t_hc1), m_new, col_new, stays)
    return SelectionPlan(moves, blocks, _id_runs(ent, layout.host_col_offsets), owned)


def _owners(layout: Layout, dslots: list[ParamSlot]) -> list[int]:
    """The number of the device block of each matrix of ``dslots`` (in device column order, as the
    blocks are: layout.py ``plan_layout``)."""
    owner, b = [], 0
    for s in dslots:
        while not (not layout.blocks[b].fixed and layout.blocks[b].length == s.rows
                   and layout.blocks[b].col0 <= s.dev_col0 < layout.blocks[b].col0 + layout.blocks[b].ncols):
            b += 1
        owner.append(b)
    return owner


def _host_ids(dslots: list[ParamSlot], kn: list[int], host: tuple[torch.Tensor, ...], m_new: torch.Tensor,
              col_new: torch.Tensor, stays: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat host column ids of the new columns inside each matrix's owned range (data
    parallel: this rank's), and of the entering ones among them, both sorted: the device-order
    arrays (``plan_selection``) taken matrix by matrix in host column order (by host_col0), where
    the ids of consecutive matrices follow each other. One permutation, a fixed number of ops."""
    horder = sorted(range(len(dslots)), key=lambda j: (dslots[j].host_col0, j))
    first = [0]  # each matrix's first position in the device-order arrays
    for c in kn[:-1]:
        first.append(first[-1] + c)
    shift, at = [], 0  # device-order position - host-order position, per matrix in host order
    for j in horder:
        shift.append(first[j] - at)
        at += kn[j]
    hn = torch.tensor([kn[j] for j in horder])
    perm = torch.arange(at) + torch.tensor(shift, dtype=torch.int64).repeat_interleave(hn)
    mh, ch = m_new.index_select(0, perm), col_new.index_select(0, perm)
    hoff, hc0, hc1 = (t.index_select(0, mh) for t in host)
    inside = (ch >= hc0) & (ch < hc1)
    hid = ch + hoff
    owned = hid.index_select(0, torch.nonzero(inside).flatten())
    ent = hid.index_select(0, torch.nonzero(inside & ~stays.index_select(0, perm)).flatten())
    return owned, ent


def _id_runs(ids: torch.Tensor, col_offsets: torch.Tensor) -> torch.Tensor:
    """``layout.column_runs`` of the mask that is True at the sorted, distinct column ids ``ids``
    (O(ids), not O(columns)): a run ends where the next id is not the next column."""
    cut = torch.nonzero(ids[1:] != ids[:-1] + 1).flatten()
    starts = torch.cat([ids[:1], ids.index_select(0, cut + 1)])
    ends = torch.cat([ids.index_select(0, cut), ids[-1:]]) + 1
    off = col_offsets.index_select(0, starts)
    return torch.stack([off, col_offsets.index_select(0, ends) - off], dim=1)
