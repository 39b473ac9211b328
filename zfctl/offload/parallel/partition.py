"""Data-parallel ZenFlow: host state partitioned across ranks by columns, and the traffic model.

With a process group of ``W`` ranks, every rank keeps the *device* half of the state in full
(dense params and the selected columns: identical on every rank, because every rank steps them
with the same averaged gradient), and only a *slice* of the host half: the flat host column space
(all matrices' columns, column-major, see ``layout``) is cut into ``W`` contiguous ranges of whole
columns, balanced by elements. Rank ``r`` holds fp32 master, moments, counters and gradient slots
of its range only, lands only those columns, and its CPU worker updates only those. A
matrix may straddle two ranks; a column never does.

Communication per optimizer step (``N`` = elements of all params, ``H`` = elements of the
matrices, ``r`` = topk_ratio, ``b`` = bytes per gradient/param element; bytes sent per rank in
the ring model below, which is what ``StepStats.comm_bytes`` counts). The gradient exchange
itself is ``exchange.GradExchange``:

* gradients: the replicated elements (dense params and the selected columns, ``~r H + (N-H)``)
  all-reduced, ``2 (W-1)/W`` of their bytes; the host-path columns reduce-scattered to their
  owners, ``(W-1)/W * (1-r) H * b``; one all-reduce of a few floats (the owners' partial sums
  of squares for the clip norm, and with the auto interval their L1 mass per matrix). At
  ``r = 0.1``, ``W = 2``: ``~0.55 N b`` instead of a full all-reduce's ``N b``.
* at a CPU-update install (every ``update_interval`` steps): each owner broadcasts its updated
  non-selected columns in the model dtype, ``(W-1)/W * (1-r) H * b`` per rank, i.e. one
  all-gather of them, amortised over the interval (``/U`` per step).
* at a selection: the per-column L1 scores (4 B per column of each selectable matrix) and the
  entering columns' gradients (their owners' values, zeros elsewhere) all-reduced; the state
  (master, two moments, counter: 12 B + 4 B per column) of the entering columns summed from
  their owners the same way (``OwnedRows``), ``~2 (W-1)/W * k_new * rows * 16 B``.

A full all-reduce of gradients plus replicated host state (what DDP + a per-rank CPU optimizer
would do) costs more gradient traffic and ``W`` times the host memory and CPU AdamW work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from zfctl.offload.layout import Layout

# Collectives move flat buckets of at most this many bytes (all-reduces), or rounds of at most
# this many bytes over all owners (the reduce-scatter and the install broadcasts, exchange.py):
# one flat copy per bucket is the transient memory they cost, one collective per bucket the latency.
BUCKET_BYTES = 64 * 2**20


# Bytes *sent by one rank* for each collective the engine issues (StepStats.comm_bytes), for a
# message of ``nbytes`` on ``W`` ranks, in the ring model: what a ring algorithm sends per rank.
# Counted from what is issued, not measured on the wire, so the number does not depend on which
# algorithm the backend picks for a given message size.
def all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Ring all-reduce: a reduce-scatter then an all-gather, ``2 (W-1)/W * n``."""
    return 2 * (world_size - 1) * nbytes // world_size


def reduce_scatter_bytes(nbytes: int, kept: int) -> int:
    """Reduce-scatter of ``nbytes`` in all, ``kept`` of them ending on this rank: every segment
    but one's own leaves once, ``n - kept`` (``(W-1)/W * n`` for equal segments)."""
    return nbytes - kept


def broadcast_bytes(nbytes: int, world_size: int) -> int:
    """Pipelined (chain) broadcast: ``W-1`` of the ``W`` ranks forward the whole message, counted
    as the per-rank mean ``(W-1)/W * n``, so one broadcast per owner adds up to one all-gather."""
    return (world_size - 1) * nbytes // world_size


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


@dataclass
class Bucket:
    """A launched all-reduce: the flat sum buffer, its work handle, and the tensors it came from."""

    flat: torch.Tensor
    work: Any
    tensors: list[torch.Tensor]
    in_place: bool = False  # ``flat`` is the one tensor itself: nothing to copy back


def launch_buckets(tensors: list[torch.Tensor], group: Any) -> list[Bucket]:
    """Start summing contiguous ``tensors`` over the group (asynchronous all-reduces), in flat
    buckets of at most ``BUCKET_BYTES``; finish with :func:`finish_buckets`.

    Every rank must pass the same shapes in the same order. One flat copy per bucket in, one out:
    two extra passes over the data, next to the network time; one collective per bucket, not per
    tensor. A bucket of one contiguous tensor (the hook path sends one matrix at a time) is summed
    in place instead: the tensor is not read or written by anyone else until the bucket is
    finished. The bucket boundaries decide the summation order of a ring all-reduce on 3+ ranks,
    so callers that must agree bit for bit pass the same tensors in the same groups (in place or
    not, the buffer is the same bytes).
    """
    buckets: list[Bucket] = []
    size = 0
    group_of: list[torch.Tensor] = []

    def launch() -> None:
        in_place = len(group_of) == 1 and group_of[0].is_contiguous()
        flat = group_of[0].view(-1) if in_place else torch.cat([t.reshape(-1) for t in group_of])
        work = dist.all_reduce(flat, group=group, async_op=True)  # sum over ranks
        buckets.append(Bucket(flat, work, list(group_of), in_place))

    for t in tensors:
        if group_of and (t.dtype != group_of[0].dtype or size + t.numel() * t.element_size() > BUCKET_BYTES):
            launch()
            group_of, size = [], 0
        group_of.append(t)
        size += t.numel() * t.element_size()
    if group_of:
        launch()
    return buckets


def finish_buckets(buckets: list[Bucket], world_size: int, *, divide: bool) -> int:
    """Wait for launched buckets and copy the sums back (``divide``: by the world size, the mean);
    returns the bytes this rank sent."""
    total = 0
    for b in buckets:
        b.work.wait()
        if divide:
            b.flat.div_(world_size)
        o = 0
        for t in b.tensors if not b.in_place else ():
            t.view(-1).copy_(b.flat[o : o + t.numel()])
            o += t.numel()
        total += all_reduce_bytes(b.flat.numel() * b.flat.element_size(), world_size)
    return total


def all_reduce_buckets(tensors: list[torch.Tensor], group: Any, world_size: int, *, divide: bool) -> int:
    """Sum (``divide``: average) ``tensors`` over the group in place, bucketed; bytes sent."""
    return finish_buckets(launch_buckets(tensors, group), world_size, divide=divide)


class OwnedRows:
    """A host ColumnState tensor seen as if it had a row for every column of the matrix.

    ``selection.migrate`` indexes host state by column id. Here only ``[c0, c1)`` exist: writes of
    other columns are dropped (their owner writes them), and reads are summed over the group with
    zeros in the rows a rank does not own (x + 0 is exact), so every rank receives the owner's
    bytes: one all-reduce per state tensor, at selections only, on the device (where the rows go).
    ``sent`` counts this rank's bytes of those all-reduces (``all_reduce_bytes``).
    """

    def __init__(self, rows: torch.Tensor, c0: int, c1: int, group: Any, device: torch.device) -> None:
        self.rows, self.c0, self.c1, self.group, self.device = rows, c0, c1, group, device
        self.sent = 0

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
        self.sent += all_reduce_bytes(out.numel() * out.element_size(), dist.get_world_size(self.group))
        return out
