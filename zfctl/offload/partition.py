"""Data-parallel ZenFlow: gradient averaging and host state partitioned across ranks by columns.

With a process group of ``W`` ranks, every rank keeps the *device* half of the state in full
(dense params and the selected columns: identical on every rank, because every rank steps them
with the same averaged gradient), and only a *slice* of the host half: the flat host column space
(all matrices' columns, column-major, see ``layout``) is cut into ``W`` contiguous ranges of whole
columns, balanced by elements. Rank ``r`` holds fp32 master, moments, counters and accumulators
of its range only, accumulates only those columns, and its CPU worker updates only those. A
matrix may straddle two ranks; a column never does.

Communication per optimizer step (``N`` = elements of all params, ``H`` = elements of the
matrices, ``b`` = bytes per gradient/param element, ring algorithms, bytes sent per rank):

* gradients: one all-reduce of the whole gradient, ``2 (W-1)/W * N * b``, the same as DDP.
  Every rank then holds the averaged gradient, so the grad norm, the column scores of a
  selection and the auto-interval masses are computed locally and are identical on all ranks:
  no extra collective, and selection is deterministic by construction.
* at a CPU-update install (every ``update_interval`` steps): each owner broadcasts its updated
  columns in the model dtype, ``(W-1)/W * H * b`` received per rank, i.e. one all-gather of the
  matrices, amortised over the interval (``/U`` per step).
* at a selection: the state (master, two moments, counter: 12 B + 4 B per column) of the
  *entering* columns is summed from their owners (zeros elsewhere), ``~2 * k_new * rows * 12 B``.

A full all-reduce of gradients plus replicated host state (what DDP + a per-rank CPU optimizer
would do) costs the same gradient traffic but ``W`` times the host memory and CPU AdamW work.
Not done yet (documented trade-off): a reduce-scatter of the host-path columns to their owners
(``(W-1)/W * (1-r) H * b``) plus an all-reduce of only the device-path elements and an all-gather
of per-column L1 scores at selections would cut gradient traffic about in half at ``r = 0.1``;
it needs the clip norm assembled from per-owner partial sums before any accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from zfctl.offload.layout import Layout, as_matrix

# Gradients are averaged in buckets of at most this many bytes: one flat copy per bucket is the
# transient memory the all-reduce costs (and one collective per bucket its latency).
BUCKET_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Piece:
    """Columns ``[c0, c1)`` of slot ``index`` are owned by rank ``owner`` (group rank)."""

    index: int
    owner: int
    c0: int
    c1: int


@dataclass(frozen=True)
class Partition:
    """This rank's place in the group and who owns which host columns."""

    group: Any
    rank: int
    world_size: int
    bounds: tuple[int, ...]  # W+1 flat global host column ids: rank r owns [bounds[r], bounds[r+1])
    pieces: tuple[Piece, ...]  # every (slot, owner) column range, in slot then owner order

    def owner_rank(self, owner: int) -> int:
        """The global rank of group rank ``owner`` (what broadcast's ``src`` wants)."""
        return dist.get_global_rank(self.group, owner) if self.group is not dist.group.WORLD else owner


def group_info(process_group: Any) -> tuple[int, int]:
    """(rank, world size) in ``process_group``; (0, 1) without one or without torch.distributed."""
    if process_group is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def split_columns(col_offsets: torch.Tensor, world_size: int) -> tuple[int, ...]:
    """Cut ``len(col_offsets) - 1`` columns into ``world_size`` ranges balanced by elements.

    Cut ``i`` is the column boundary nearest to ``i/W`` of the elements, so no range differs from
    the ideal by more than half of its widest column.
    """
    ncols = len(col_offsets) - 1
    total = int(col_offsets[-1])
    bounds = [0]
    for i in range(1, world_size):
        target = total * i / world_size
        j = int(torch.searchsorted(col_offsets, torch.tensor(int(target))))
        j = min(max(j, 1), ncols)
        if j > 0 and target - int(col_offsets[j - 1]) < int(col_offsets[j]) - target:
            j -= 1
        bounds.append(max(bounds[-1], j))
    bounds.append(ncols)
    return tuple(bounds)


def partition_layout(
    layout: Layout, process_group: Any, rank: int, world_size: int
) -> tuple[Layout, Partition]:
    """This rank's layout (host offsets renumbered over its own columns) and the ownership map."""
    bounds = split_columns(layout.host_col_offsets, world_size)
    lo, hi = bounds[rank], bounds[rank + 1]
    slots, pieces, col, off, offsets = [], [], 0, 0, [0]
    for s in layout.slots:
        if not s.on_host:
            slots.append(s)
            continue
        g0, g1 = s.host_col0, s.host_col0 + s.cols  # this matrix in the global column space
        for r in range(world_size):
            a, b = max(g0, bounds[r]), min(g1, bounds[r + 1])
            if a < b:
                pieces.append(Piece(s.index, r, a - g0, b - g0))
        a, b = max(g0, lo), min(g1, hi)
        c0, c1 = (a - g0, b - g0) if a < b else (0, 0)
        slots.append(replace(s, host_c0=c0, host_c1=c1, host_col0=col, host_off=off))
        offsets.extend(off + s.rows * (j + 1) for j in range(c1 - c0))
        col += c1 - c0
        off += (c1 - c0) * s.rows
    local = replace(
        layout,
        slots=tuple(slots),
        host_numel=off,
        host_cols=col,
        host_col_offsets=torch.tensor(offsets, dtype=torch.int64),
    )
    return local, Partition(process_group, rank, world_size, bounds, tuple(pieces))


def average_one(grad: torch.Tensor, group: Any, world_size: int) -> int:
    """All-reduce one gradient to the mean over ranks, in place (the gradient hooks' version of
    ``average_gradients``: the same sum, then the same division, so each element gets the same
    bits for 2 ranks; with more, the reduction order inside the collective may differ by
    bucketing). Returns the bytes reduced."""
    dist.all_reduce(grad, group=group)  # sum over ranks
    grad.div_(world_size)
    return grad.numel() * grad.element_size()


def average_gradients(params: list[torch.Tensor], group: Any, world_size: int) -> int:
    """All-reduce every ``.grad`` to the mean over ranks, in flat buckets; returns bytes reduced.

    A missing gradient becomes zeros first (the optimizer steps it as zero anyway), so every rank
    contributes the same tensors in the same order. One flat copy per bucket (at most
    ``BUCKET_BYTES``) in, one out: two extra passes over the gradient, next to the network time.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    total, size = 0, 0
    bucket: list[torch.Tensor] = []

    def flush() -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)  # sum over ranks
        flat.div_(world_size)
        o = 0
        for g in bucket:
            g.view(-1).copy_(flat[o : o + g.numel()])
            o += g.numel()

    for p in params:
        g = p.grad
        assert g is not None  # a missing gradient became zeros above
        if bucket and (g.dtype != bucket[0].dtype or size + g.numel() * g.element_size() > BUCKET_BYTES):
            flush()
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
        total += g.numel() * g.element_size()
    if bucket:
        flush()
    return total


def share_installed(part: Partition, layout: Layout, params: list[torch.Tensor]) -> int:
    """Broadcast each owner's freshly installed columns to every rank; returns bytes received.

    The owner's params already hold its CPU update (and the device-owned columns restored from
    the device master, which every rank has identically), so the whole owned range is sent as is.
    One broadcast per (matrix, owner) piece, in the same order on every rank.
    """
    received = 0
    for pc in part.pieces:
        slot = layout.slots[pc.index]
        cols = as_matrix(params[pc.index].data, slot)[:, pc.c0 : pc.c1]
        buf = cols.contiguous()  # a strided column range -> one contiguous message
        dist.broadcast(buf, src=part.owner_rank(pc.owner), group=part.group)
        if pc.owner != part.rank:
            cols.copy_(buf)
            received += buf.numel() * buf.element_size()
    return received


class OwnedRows:
    """A host ColumnState tensor seen as if it had a row for every column of the matrix.

    ``selection.migrate`` indexes host state by column id. Here only ``[c0, c1)`` exist: writes of
    other columns are dropped (their owner writes them), and reads are summed over the group with
    zeros in the rows a rank does not own (x + 0 is exact), so every rank receives the owner's
    bytes: one all-reduce per state tensor, at selections only, on the device (where the rows go).
    """

    def __init__(self, rows: torch.Tensor, c0: int, c1: int, group: Any, device: torch.device) -> None:
        self.rows, self.c0, self.c1, self.group, self.device = rows, c0, c1, group, device

    def _mine(self, cols: torch.Tensor) -> torch.Tensor:
        return (cols >= self.c0) & (cols < self.c1)

    def index_copy_(self, dim: int, cols: torch.Tensor, src: torch.Tensor) -> None:
        mine = self._mine(cols)
        self.rows.index_copy_(0, cols[mine] - self.c0, src[mine])

    def index_select(self, dim: int, cols: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((len(cols), *self.rows.shape[1:]), dtype=self.rows.dtype)
        if len(cols) == 0:
            return out  # every rank agrees on the selection, so all skip the collective together
        mine = self._mine(cols)
        out[mine] = self.rows.index_select(0, cols[mine] - self.c0)
        out = out.to(self.device)  # PCIe H2D; NCCL reduces device tensors only
        dist.all_reduce(out, group=self.group)
        return out
