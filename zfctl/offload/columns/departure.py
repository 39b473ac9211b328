"""Where a selection's leaving rows wait to be written into their host rows (``Departure``), and
one state tensor's device and host sides as the migration moves it (``Pair``): migration.py's
vocabulary, used by selector.py and release.py too.

Owners: a ``Departure`` is filled by the main thread as the out copies are enqueued and emptied
(``finish``) by whichever thread comes first: the CPU worker behind the update in flight (the
state), or the main thread (a release step's gradient: selector.py ``land``; an out buffer that
must be reused: migration.py ``_make_room``). Its lock makes ``finish`` safe to call from both.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zfctl.offload.ledger import NOWHERE, Ledger

# The bounded scratch of a gather or scatter that also changes dtype (no torch op does both: index_select
# and index_copy_ require one dtype): a block of rows at a time goes through a scratch this small, which
# stays in the cache, so the rows cross memory once instead of twice through a full-size temporary.
CAST_BYTES = 1 << 19


def _block(width: int, itemsize: int) -> int:
    return max(1, CAST_BYTES // (width * itemsize))


def gather_cast(src: torch.Tensor, cols: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = src[cols[i]]`` converted to ``out``'s dtype (a release step's gradient slot widened
    into the in ring, exact): one op when the dtypes match, else a block of rows at a time through
    a ``CAST_BYTES`` scratch owned by this call."""
    if src.dtype == out.dtype:
        torch.index_select(src, 0, cols, out=out)
        return
    n, width = out.shape
    step = _block(width, src.element_size())
    scratch = torch.empty(min(n, step), width, dtype=src.dtype, device=src.device)
    for a in range(0, n, step):
        b = min(n, a + step)
        torch.index_select(src, 0, cols[a:b], out=scratch[: b - a])
        out[a:b].copy_(scratch[: b - a])


def scatter_cast(dst: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[cols[i]] = rows[i]`` converted to ``dst``'s dtype (leaving fp32 rows narrowed into a
    release step's model-dtype gradient slot, exact): as ``gather_cast``, one op or a block at a time
    through a ``CAST_BYTES`` scratch owned by this call."""
    if rows.dtype == dst.dtype:
        dst.index_copy_(0, cols, rows)
        return
    n, width = rows.shape
    step = _block(width, dst.element_size())
    scratch = torch.empty(min(n, step), width, dtype=dst.dtype, device=dst.device)
    for a in range(0, n, step):
        b = min(n, a + step)
        scratch[: b - a].copy_(rows[a:b])
        dst.index_copy_(0, cols[a:b], scratch[: b - a])


class Departure:
    """Leaving rows that have left the device (or are on their way) and wait in the out buffer to
    be written into their host rows. ``finish`` may run on any thread, more than once. Its waits
    count as ``kind`` (ledger.py: ``worker.migrate`` for the state, ``host.migrate_land`` for a
    release step's gradient), its bytes into the tab current where it was made (the selection
    step's, whichever thread runs it)."""

    def __init__(self, fence: Callable[[], Any] | None = None, *, ledger: Ledger = NOWHERE,
                 kind: str = "worker.migrate") -> None:
        self._fence = fence  # the last install's DMA, which may still read the master or the upload
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, float, torch.Tensor | None]] = []
        self._lock = threading.Lock()
        self.ledger, self.kind = ledger, kind
        self._tab = ledger.tab()

    def add(self, host: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor, event: Any, scale: float,
            mirror: torch.Tensor | None = None) -> None:
        with self._lock:
            self._parts.append((host, cols, rows, event, scale, mirror))

    @property
    def pending(self) -> bool:
        with self._lock:
            return bool(self._parts)

    def finish(self, kind: str | None = None) -> None:
        """Write every landed row into its host rows (each piece's D2H event waited for first; its
        waits counted as ``kind``, by default the Departure's own)."""
        kind = kind or self.kind
        with self._lock, self.ledger.charging(self._tab):
            parts, self._parts = self._parts, []
            if parts and self._fence is not None:
                with self.ledger.waiting(kind):
                    self._fence()  # sync point: the install's DMA no longer reads these master/upload rows
            last = None
            for host, cols, rows, event, scale, mirror in parts:
                if event is not None and event is not last:
                    with self.ledger.waiting(kind):
                        event.synchronize()  # sync point (worker, normally long fired): this piece's D2H
                    last = event
                nbytes = rows.numel() * rows.element_size()
                if scale != 1.0:
                    rows.mul_(scale)  # exact: a power of two
                    self.ledger.moved("host.stage", 2 * nbytes)  # read and written in place
                # A release step's gradient slot is in the model dtype (slots.py): narrowed here,
                # exactly (the device widened these values from it), with no full-size temporary.
                scatter_cast(host, cols, rows)
                self.ledger.moved("host.stage", nbytes)  # the out buffer read ...
                self.ledger.moved("host.migrate", rows.numel() * host.element_size())  # ... into the host rows
                if mirror is not None:  # the leaving columns' model-dtype copy (selector.py ``_migrate``)
                    scatter_cast(mirror, cols, rows)
                    self.ledger.moved("host.migrate", rows.numel() * mirror.element_size())


@dataclass(frozen=True)
class Pair:
    """The host side of one state tensor of one matrix (its device side is its block's rows:
    groups.py ``Group``): host rows ``[cols, width]`` by column id; its leaving rows go to
    ``to``. ``scale`` (release.py's gradient: the fp16 loss scale's inverse, a power of two,
    exact): the host holds ``scale`` times the device's values."""

    host: torch.Tensor
    to: Departure
    scale: float = 1.0
    leaves: bool = True  # False: its leaving rows are written by the caller (the step counters)
    mirror: torch.Tensor | None = None  # host rows that also take the leaving rows, in their dtype (the upload)
