"""Column-range chunks of the host-owned matrices, and the install that moves them host to device
(``install_params``). Gradients move device to host chunk by chunk into the step's slot
(stream.py: from the hooks or from step()); the device path (device_acc.py) moves only the
interval sum.

A chunk is a range of whole columns ``[c0, c1)`` of one matrix, as many as fit in a ring slot.
Chunks whose columns are all device-owned are skipped. Both directions move whole column ranges:
the device-owned columns inside a chunk (about ``topk_ratio`` of the bytes) ride along because
dropping them would take a device gather per chunk and a host scatter per run (one native call
each), which costs more than the bytes it saves. On the host, the run lists make the CPU AdamW
(which also writes the upload buffer the install reads) skip them; on the device, the install
puts them back from the device master (install.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zfctl.offload.device.ring import Ring
from zfctl.offload.layout import Layout, ParamSlot, as_matrix, column_runs


@dataclass(frozen=True)
class Chunk:
    """Columns [c0, c1) of ``slot``; ``off`` its flat host element offset; ``runs`` its host-owned
    elements relative to ``off`` (None: all of them)."""

    slot: ParamSlot
    c0: int
    c1: int
    off: int
    runs: torch.Tensor | None

    @property
    def numel(self) -> int:
        return (self.c1 - self.c0) * self.slot.rows


def plan_chunks(layout: Layout, device_owned: torch.Tensor, slot_bytes: int, itemsize: int) -> list[Chunk]:
    """Split every host-owned matrix into slot-sized column ranges (recomputed at each selection)."""
    chunks = []
    for slot in layout.host_slots:
        per = max(1, slot_bytes // (slot.rows * itemsize))
        for c0 in range(slot.host_c0, slot.host_c1, per):
            c1 = min(c0 + per, slot.host_c1)
            g0 = slot.host_col0 + c0 - slot.host_c0  # flat host column ids [g0, g1)
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


def install_params(ring: Ring, chunks: list[Chunk], source: torch.Tensor, params: list[torch.Tensor], *,
                   stream: Any = None, finished: Callable[[ParamSlot], None] | None = None) -> tuple[int, Any]:
    """Copy the host's new values of whole column ranges into the model params (PCIe H2D).

    ``source`` is the install source (HostState.install_source): the upload buffer, which the CPU
    AdamW wrote in the model dtype (round to nearest even, native/kernels.h), and the scatter is a
    plain copy; or the fp32 master (an fp32 model, or no upload buffer), which ``copy_`` into a
    bf16/fp16 param rounds to nearest even on the device, the same bits. ``stream``: where the scatters run
    (the install stream, install.py; None: the current stream). ``finished(slot)`` runs on that
    stream after a param's last chunk (the chunks of one param are consecutive): the caller puts
    the device-owned columns back there, since the column ranges carried them stale. Returns
    (bytes copied, the event after the last copy that reads ``source``, or None when the copies
    were synchronous): the next writer of ``source`` waits for it (``HostState.install_fence``).
    """
    last = {ch.slot.index: i for i, ch in enumerate(chunks)}  # each param's last chunk

    def deliver(dev: torch.Tensor, item: tuple[int, Chunk]) -> None:
        i, ch = item
        pm = as_matrix(params[ch.slot.index].data, ch.slot)
        pm[:, ch.c0 : ch.c1].copy_(dev.view(ch.c1 - ch.c0, ch.slot.rows).t())
        if finished is not None and last[ch.slot.index] == i:
            finished(ch.slot)

    return ring.h2d(((source[ch.off : ch.off + ch.numel], (i, ch)) for i, ch in enumerate(chunks)), deliver,
                    stream=stream)
