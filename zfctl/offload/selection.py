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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from zfctl.offload import pinned
from zfctl.offload.ledger import NOWHERE, Ledger


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


class Staging:
    """A reused host buffer (page-locked on CUDA, pinned.py) that every migration copy goes through.

    Without it each copy of a migration landed in (or was gathered into) a freshly allocated
    pageable tensor: a pageable PCIe copy (staged by the driver, several times slower than a DMA)
    plus first-touch page faults on every new page, twice per byte moved, and at 1B parameters a
    selection moves ~1.3 GB each way. The buffer is allocated once (the first selection) and
    reused; transfers larger than it go in pieces of whole columns, one blocking copy each (a
    stream sync per piece, selection steps only). Host memory: ``STAGE_BYTES`` (sizing.py; or one column).
    ``ledger``: where the host bytes and the blocking copies of the pieces are counted (ledger.py).
    """

    ledger: Ledger = NOWHERE

    def __init__(self, elems: int, *, pin: bool, device: torch.device | None) -> None:
        self.buf = pinned.empty(elems, torch.float32, pin=pin, device=device)

    def per_piece(self, row_numel: int) -> int:
        """Whole rows (columns of a matrix) that fit in one piece."""
        return max(1, self.buf.numel() // max(1, row_numel))

    def view(self, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        return self.buf[:n].view(shape)

    def release(self) -> None:
        pinned.release(self.buf)


def migrate(dev: ColumnState, host: Sequence[HostRows], old: torch.Tensor | None,
            new: torch.Tensor, stage: Staging | None = None) -> tuple[int, int]:
    """Move state so that ``dev`` rows hold the columns ``new`` (sorted), previously ``old``.

    ``host``: the same four states in ``ColumnState`` order, rows indexed by column id (the whole
    owned range). Returns (d2h_bytes, h2d_bytes). Cost: two tiny index copies to the host (a
    device sync; selection steps only), a D2H per state tensor for the leaving columns and an H2D
    for the entering ones; with ``stage`` (host tensors only) each goes through its page-locked
    buffer in pieces, the host gathering and scattering in place, no new host memory.
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
            if stage is not None and isinstance(h, torch.Tensor):
                d2h += out_staged(d, pos, h, cols, stage)
                continue
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
        if stage is not None and isinstance(h, torch.Tensor):
            h2d += in_staged(d, enter_dst, h, enter_cols, stage)
            continue
        entering = h.index_select(0, enter_cols).to(device)  # PCIe H2D
        h2d += entering.numel() * entering.element_size()
        d.index_copy_(0, enter_dst, entering)
    return d2h, h2d


def out_staged(d: torch.Tensor, pos: torch.Tensor, h: torch.Tensor, cols: torch.Tensor, stage: Staging,
               mul: float | None = None) -> int:
    """Device rows ``pos`` of ``d`` into host rows ``cols`` of ``h`` (times ``mul``, on the host, if
    given), through ``stage``; bytes moved."""
    per, moved, ledger = stage.per_piece(math.prod(d.shape[1:])), 0, stage.ledger
    for a in range(0, len(cols), per):
        tmp = d.index_select(0, pos[a : a + per])  # a device gather of this piece's rows
        buf = stage.view(tuple(tmp.shape))
        nbytes = tmp.numel() * tmp.element_size()
        with ledger.waiting("host.migrate_copy"):
            buf.copy_(tmp)  # PCIe D2H into page-locked memory; blocking: a stream sync per piece
        if mul is not None:
            buf.mul_(mul)
        h.index_copy_(0, cols[a : a + per], buf)
        # the DMA writes the stage, (mul: reads and writes it), the scatter reads it and writes h
        ledger.moved("host.stage", nbytes * (4 if mul is not None else 2))
        ledger.moved("host.migrate", nbytes)
        moved += nbytes
    return moved


def in_staged(d: torch.Tensor, dst: torch.Tensor, h: torch.Tensor, cols: torch.Tensor, stage: Staging,
              div: float | None = None) -> int:
    """Host rows ``cols`` of ``h`` (divided by ``div``, on the host, if given) into device rows
    ``dst`` of ``d``, through ``stage``; bytes moved."""
    per, moved, ledger = stage.per_piece(math.prod(h.shape[1:])), 0, stage.ledger
    for a in range(0, len(cols), per):
        c = cols[a : a + per]
        buf = stage.view((len(c), *h.shape[1:]))
        torch.index_select(h, 0, c, out=buf)  # host gather, in place: no fresh pages
        if div is not None:
            buf.div_(div)
        # PCIe H2D from page-locked memory; blocking (the buffer is reused next piece). Off CUDA
        # ``to`` returns ``buf`` itself, which index_copy_ reads before the next piece rewrites it.
        with ledger.waiting("host.migrate_copy"):
            d.index_copy_(0, dst[a : a + per], buf.to(d.device))
        nbytes = buf.numel() * buf.element_size()
        # the gather reads h and writes the stage, (div: reads and writes it), the DMA reads it
        ledger.moved("host.migrate", nbytes)
        ledger.moved("host.stage", nbytes * (4 if div is not None else 2))
        moved += nbytes
    return moved
