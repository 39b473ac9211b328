"""The unfinished interval's gradient sum as a checkpoint stores it, formed as it is read.

A checkpoint taken inside an interval stores the raw fp32 sum of the interval's steps so far
(``acc``, docs/design.md, "Checkpoint format"). On the slots layout that sum exists nowhere: the
CPU worker forms it inside its AdamW pass at the boundary. Formed into a new buffer it would cost
4 B per host element for as long as the save runs (27 GB at 7B), on a host the plan may have
filled. A :class:`PartialSum` holds no elements: it is a range of that sum with a shape, and its
elements are computed when they are read, one chunk at a time, by the gradient layout's
``partial_sum_into(s, out, lo, hi)`` (slots.py: the worker's fma chain over the range), then made
canonical (the device-owned columns' elements, which nothing reads, as zeros: ``zero_dead``).

Who reads it: the checkpoint writer (zfctl/train/checksum.py ``write_tensor``: ``chunks``, one
reused fp32 scratch of ``CHUNK_BYTES``), a load into live buffers (``copy_to``, as a
checkpoint file's ``FileTensor``), and ``load`` (a new tensor: ``Pipeline.state_dict`` without
``stream``, what ``torch.optim``'s ``state_dict`` returns). ``split_host`` cuts it into pieces
like a tensor (``__getitem__`` on the first dimension, ``view``). Like the live buffers a state
dict holds, it is valid until the optimizer's next step: it reads the slots as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from zfctl.offload.layout import Layout
from zfctl.offload.sizing import CHUNK_BYTES

# Elements [lo, hi) of the sum into the fp32 host buffer given (``hi - lo`` elements).
FillRange = Callable[[torch.Tensor, int, int], None]


class PartialSum:
    """Elements ``[lo, lo + numel)`` of an interval's fp32 partial sum, shaped ``shape``
    (row-major), computed by ``fill`` when read."""

    dtype = torch.float32

    def __init__(self, fill: FillRange, lo: int, shape: tuple[int, ...]) -> None:
        self.fill, self.lo, self.shape = fill, lo, tuple(shape)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def element_size(self) -> int:
        return 4

    @property
    def nbytes(self) -> int:
        return 4 * self.numel()

    def __getitem__(self, rows: slice) -> PartialSum:
        """Rows ``[start, stop)`` of the first dimension (contiguous rows only)."""
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("PartialSum slices take contiguous rows only")
        row = self.numel() // self.shape[0] if self.shape[0] else 0
        return PartialSum(self.fill, self.lo + start * row, (max(0, stop - start), *self.shape[1:]))

    def view(self, *shape: int) -> PartialSum:
        """The same elements in another shape (``-1`` allowed once)."""
        dims = list(shape)
        if -1 in dims:
            known = 1
            for d in dims:
                known *= d if d != -1 else 1
            dims[dims.index(-1)] = self.numel() // known if known else 0
        out = PartialSum(self.fill, self.lo, tuple(dims))
        if out.numel() != self.numel():
            raise ValueError(f"cannot view {self.numel()} elements as {shape}")
        return out

    reshape = view

    def chunks(self, nbytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """The elements in order, whole first-dimension rows at a time, each chunk in one reused
        fp32 host scratch of about ``nbytes`` (at least one row): the checkpoint's only memory
        for the sum. A chunk is valid until the next one is asked for."""
        n = self.numel()
        if n == 0:
            return
        row = n // self.shape[0] if self.shape else n
        per = max(1, nbytes // (4 * row)) * row if self.shape else n
        scratch = torch.empty(min(per, n), dtype=torch.float32)
        for a in range(0, n, per):
            part = scratch[: min(per, n - a)]
            self.fill(part, self.lo + a, self.lo + a + part.numel())
            yield part

    def copy_to(self, dst: torch.Tensor) -> None:
        """Compute the elements into ``dst`` (same number of elements): straight into a contiguous
        fp32 host tensor, else through one chunk at a time (a device tensor: one H2D per chunk)."""
        if dst.numel() != self.numel():
            raise ValueError(f"a partial sum of {self.numel()} elements cannot fill {dst.numel()}")
        if dst.device.type == "cpu" and dst.is_contiguous() and dst.dtype == torch.float32:
            if self.numel():
                self.fill(dst.reshape(-1), self.lo, self.lo + self.numel())
            return
        flat, a = dst.reshape(-1), 0
        for part in self.chunks():
            flat[a : a + part.numel()].copy_(part)
            a += part.numel()

    def load(self) -> torch.Tensor:
        """A new fp32 host tensor with the values (4 B per element while the caller holds it)."""
        out = torch.empty(self.shape, dtype=torch.float32)
        self.copy_to(out)
        return out


def zero_dead(layout: Layout, device_owned: torch.Tensor, out: torch.Tensor, lo: int, hi: int) -> None:
    """Zero the elements of device-owned columns (``device_owned``: per host column, as
    HostState's) among elements ``[lo, hi)`` of a flat host-layout buffer, held by ``out``:
    what ``HostState.canonicalize`` does to a whole buffer, for one range. Column-aligned ranges
    (every chunk of a piece) take one ``index_fill_`` per matrix; a column cut by the range is
    zeroed by its part."""
    for s in layout.host_slots:
        a, b = max(lo, s.host_off), min(hi, s.host_off + s.host_numel)
        if a >= b or s.rows == 0:
            continue
        c0, c1 = (a - s.host_off) // s.rows, -(-(b - s.host_off) // s.rows)
        ids = torch.nonzero(device_owned[s.host_col0 + c0 : s.host_col0 + c1]).flatten()
        if ids.numel() == 0:
            continue
        if (a - s.host_off) % s.rows == 0 and (b - s.host_off) % s.rows == 0:
            out[a - lo : b - lo].view(c1 - c0, s.rows).index_fill_(0, ids, 0.0)
            continue
        for c in (ids + c0).tolist():
            e0, e1 = max(a, s.host_off + c * s.rows), min(b, s.host_off + (c + 1) * s.rows)
            out[e0 - lo : e1 - lo] = 0.0
