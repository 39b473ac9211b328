"""Where every parameter's optimizer state lives: device segments and column-major host buffers.

Terms. A *dense* parameter (0-D or 1-D: biases, norm weights) is updated on the device, whole,
every step, and never has host state. Every other parameter is a *matrix* ``[rows, cols]``:
a 2-D weight ``[out, in]`` as it is (a column ``W[:, j]`` is input channel j; an embedding
``[vocab, hidden]`` has one column per hidden dimension), and a >2-D weight
``[d0, d1, d2, ...]`` is viewed as ``[d0, d1*d2*...]`` (a conv kernel's column is one
(in-channel, kh, kw) position across all output channels). That view needs a contiguous
parameter, which every ``nn.Module`` weight is; anything else is rejected at construction.

A *by-row* matrix (``ParamSlot.by_row``; the optimizer's ``vocab_params`` under
``zenflow.vocab_select: rows``) is the transpose of that view: ``[d0, rest]`` read as
``[rest, d0]``, so its columns are the parameter's rows (an embedding's or output head's columns
are then its tokens). Everything below works on ``as_matrix`` and so never sees the difference;
the host copy of a by-row matrix is the parameter's own row-major order.

Host buffers. All matrices share flat fp32 host buffers (master, moments, gradient slots) in
column-major order, so column c of the flat *column space* is the contiguous run
``[col_offsets[c], col_offsets[c+1])``. Non-selected columns become (offset, length) runs for the
native kernels, and a run may cross from one parameter into the next: the kernels are
element-wise, so one native call covers every parameter. Each matrix owns the column range
``[c0, c1)`` of itself on the host; in a single process that is the whole matrix. Partitioning
host state across data-parallel ranks will give each rank a sub-range, never a split column.

Device buffers. Dense params and the selected columns of every matrix live in flat fp32 device
buffers too. Device *columns* of the same length (a matrix's selected columns have ``rows``
elements; a dense param is one column of ``numel``) are stored next to each other, so each
length forms one ``[n, length]`` block and the AdamW math with per-column bias correction is a
handful of broadcast ops per block instead of per parameter (a tiny Llama has four blocks).
Columns that are device-owned from step 0 (dense params, and matrices whose ``k`` is all their
columns) come first, so that before the first selection the device steps a prefix of the buffers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from zfctl.offload.sizing import num_selected  # the plan counts selected columns by it, without torch


@dataclass(frozen=True)
class ParamSlot:
    """One trainable parameter and the offsets of its state in the flat buffers."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dense: bool  # 0-D/1-D: always on the device, never on the host
    rows: int  # elements per column (numel for a dense param)
    cols: int  # columns (1 for a dense param)
    k: int  # columns on the device (1 for a dense param)
    dev_off: int  # element offset of this param's device segment ([k, rows], row = one column)
    dev_col0: int  # index of its first device column (per-column step counters)
    by_row: bool = False  # columns are the parameter's rows: the [rest, d0] view (module docstring)
    host_c0: int = 0  # owned host column range [host_c0, host_c1) of this matrix
    host_c1: int = 0
    host_col0: int = 0  # flat host column index of column host_c0
    host_off: int = 0  # flat host element offset of column host_c0

    @property
    def on_host(self) -> bool:
        """True when some columns of this matrix can be deferred to the CPU."""
        return not self.dense and self.k < self.cols

    @property
    def fixed(self) -> bool:
        """True when the device owns all of this param from step 0 (no selection, no host state)."""
        return self.dense or self.k == self.cols

    @property
    def selects(self) -> bool:
        """True when a top-k choice exists (some but not all columns on the device)."""
        return not self.dense and 0 < self.k < self.cols

    @property
    def host_numel(self) -> int:
        return (self.host_c1 - self.host_c0) * self.rows

    def host_view(self, buf: torch.Tensor) -> torch.Tensor:
        """This matrix's owned columns of a flat buffer laid out like the host state (the host
        buffers, the device accumulator, a checkpoint piece's buffer) as ``[ncols, rows]``."""
        return buf[self.host_off : self.host_off + self.host_numel].view(self.host_c1 - self.host_c0, self.rows)


@dataclass(frozen=True)
class DeviceBlock:
    """Device columns of equal length: elements [off, off + ncols*length), columns [col0, col0+ncols)."""

    fixed: bool  # holds only ParamSlot.fixed columns (stepped from step 0)
    length: int
    off: int
    col0: int
    ncols: int


@dataclass(frozen=True)
class Layout:
    """The state layout of one optimizer: slots, device blocks and the host column space."""

    slots: tuple[ParamSlot, ...]
    blocks: tuple[DeviceBlock, ...]
    dev_numel: int
    dev_cols: int
    fixed_numel: int  # fixed blocks come first: elements [0, fixed_numel), columns [0, fixed_cols)
    fixed_cols: int
    host_numel: int
    host_cols: int
    host_col_offsets: torch.Tensor  # int64 [host_cols + 1], element offset of each host column

    @property
    def matrices(self) -> list[ParamSlot]:
        return [s for s in self.slots if not s.dense]

    @property
    def host_slots(self) -> list[ParamSlot]:
        return [s for s in self.slots if s.on_host]


def as_matrix(t: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """The ``[rows, cols]`` view of a parameter (or its gradient) of a matrix slot (a transposed,
    non-contiguous view for a by-row slot: column j is the parameter's row j)."""
    if slot.by_row:
        return t.view(slot.cols, slot.rows).t()
    return t.view(slot.rows, slot.cols)


def gather_columns(t: torch.Tensor, slot: ParamSlot, index: torch.Tensor) -> torch.Tensor:
    """Columns ``index`` of a matrix slot's parameter or gradient as ``[len(index), rows]``.

    Gathers along the contiguous dimension, then transposes: for a column slot a gather of
    contiguous runs inside each row (faster than a strided row gather), for a by-row slot a gather
    of whole contiguous rows (no transpose needed).
    """
    if slot.by_row:
        return t.view(slot.cols, slot.rows).index_select(0, index)
    return as_matrix(t, slot).index_select(1, index).t()


def plan_layout(named: list[tuple[str, torch.Tensor]], topk_ratio: float,
                by_row: frozenset[str] = frozenset()) -> Layout:
    """Assign device and host offsets to every parameter, deterministically from the order given.

    ``by_row``: names of matrices whose columns are their rows (module docstring); a dense
    parameter named there stays dense.
    """
    shapes = []
    for name, p in named:
        dense = p.dim() <= 1
        if not dense and not p.is_contiguous():
            raise ValueError(f"parameter {name!r} is not contiguous; ZenFlow views it as [rows, cols]")
        rows = max(1, p.numel()) if dense else p.shape[0]
        cols = 1 if dense else p.numel() // p.shape[0]
        if not dense and name in by_row:
            rows, cols = cols, rows
        k = 1 if dense else num_selected(cols, topk_ratio)
        shapes.append((name, p, dense, rows, cols, k))

    # Device blocks: one per (fixed, column length), fixed ones first (they are stepped from step 0,
    # selectable matrices only after the first selection), otherwise in first-seen order.
    keys: list[tuple[bool, int]] = []
    for _, _, dense, rows, cols, k in shapes:
        key = (dense or k == cols, rows)
        if k > 0 and key not in keys:
            keys.append(key)
    keys.sort(key=lambda key: not key[0])  # stable sort
    dev_off: dict[int, tuple[int, int]] = {}
    blocks, off, col = [], 0, 0
    for fixed, length in keys:
        off0, col0 = off, col
        for i, (_, _, dense, rows, cols, k) in enumerate(shapes):
            if (dense or k == cols) == fixed and rows == length and k > 0:
                dev_off[i] = (off, col)
                off += k * rows
                col += k
        blocks.append(DeviceBlock(fixed, length, off0, col0, col - col0))
    fixed_numel = sum(b.ncols * b.length for b in blocks if b.fixed)
    fixed_cols = sum(b.ncols for b in blocks if b.fixed)

    slots, host_off, host_col, col_offsets = [], 0, 0, [0]
    for i, (name, p, dense, rows, cols, k) in enumerate(shapes):
        d_off, d_col = dev_off.get(i, (0, 0))
        slot = ParamSlot(i, name, tuple(p.shape), p.dtype, dense, rows, cols, k, d_off, d_col,
                         by_row=not dense and name in by_row)
        if slot.on_host:
            slot = replace(slot, host_c0=0, host_c1=cols, host_col0=host_col, host_off=host_off)
            col_offsets.extend(host_off + rows * (j + 1) for j in range(cols))
            host_off += rows * cols
            host_col += cols
        slots.append(slot)
    return Layout(
        slots=tuple(slots), blocks=tuple(blocks), dev_numel=off, dev_cols=col,
        fixed_numel=fixed_numel, fixed_cols=fixed_cols, host_numel=host_off, host_cols=host_col,
        host_col_offsets=torch.tensor(col_offsets, dtype=torch.int64),
    )


def vocab_matrices(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters indexed by token: the input embedding and the output head
    (``get_input_embeddings`` / ``get_output_embeddings``, the transformers API), or, for a model
    without that API, every ``nn.Embedding``. A tied pair is one parameter, named once."""
    weights: set[int] = set()
    getters = [getattr(model, g, None) for g in ("get_input_embeddings", "get_output_embeddings")]
    if any(callable(g) for g in getters):
        for g in getters:
            try:
                module = g() if callable(g) else None
            except NotImplementedError:  # transformers' base class, for models without the head
                module = None
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor):
                weights.add(id(weight))
    else:
        weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [n for n, p in model.named_parameters() if id(p) in weights and p.requires_grad and p.dim() >= 2]


def column_runs(mask: torch.Tensor, col_offsets: torch.Tensor) -> torch.Tensor:
    """(offset, length) element runs of the maximal stretches of True columns in ``mask``.

    ``col_offsets`` has one more entry than ``mask`` (the end of the last column); offsets are
    relative to ``col_offsets``'s frame. Adjacent True columns merge into one run even across
    parameters, which keeps the native kernels' run lists short. One ``nonzero`` of the mask's
    changes, which alternate start, end, start, ... (a selection's ~5*10^5 columns: ~0.8 ms on one
    thread, half of what a ``nonzero`` for the starts and one for the ends took).
    """
    pad = torch.zeros(1, dtype=torch.bool, device=mask.device)
    m = torch.cat([pad, mask.to(torch.bool), pad])
    edges = col_offsets.index_select(0, torch.nonzero(m[1:] != m[:-1]).flatten())
    off = edges[0::2]
    return torch.stack([off, edges[1::2] - off], dim=1)


def named_params(params: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """Normalise tensors / (name, tensor) pairs; drop frozen ones; reject groups and duplicates."""
    named, seen = [], set()
    for i, item in enumerate(params):
        if isinstance(item, dict):
            raise TypeError("ZenFlowOptimizer takes one parameter group: pass tensors or (name, tensor) pairs")
        name, p = item if isinstance(item, tuple) else (f"param{i}", item)
        if not isinstance(p, torch.Tensor) or not isinstance(name, str):
            raise TypeError(f"expected a tensor or a (name, tensor) pair, got {type(item).__name__}")
        if id(p) in seen:
            raise ValueError(f"parameter {name!r} is given twice")
        if not p.is_floating_point():
            raise ValueError(f"parameter {name!r} has dtype {p.dtype}; ZenFlow trains floating-point weights")
        seen.add(id(p))
        if p.requires_grad:
            named.append((name, p))
    if not named:
        raise ValueError("ZenFlowOptimizer got no trainable parameters")
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    return named
