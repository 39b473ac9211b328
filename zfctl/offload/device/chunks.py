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

from zfctl.offload.cpu.runs import cut_runs
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
    """Split every host-owned matrix into slot-sized column ranges (recomputed at each selection).

    Cost: a fixed number of torch ops over the whole host column space, none per chunk but the
    ``split`` view of its runs: one ``column_runs`` of the host-owned columns, cut at the chunk
    edges, gives every chunk's runs and, summed, how much of it the host owns.
    """
    spans: list[tuple[ParamSlot, int, int]] = []  # (slot, c0, c1) of every chunk, in host column order
    edges = [0]  # flat host column ids: chunk i is [edges[i], edges[i + 1])
    for slot in layout.host_slots:
        per = max(1, slot_bytes // (slot.rows * itemsize))
        # The owned ranges of the host slots tile the host column space in slot order (layout.py
        # plan_layout, partition.py partition_layout), so one chunk's end is the next one's start.
        assert edges[-1] == slot.host_col0, "host column ranges must tile the host column space"
        for c0 in range(slot.host_c0, slot.host_c1, per):
            c1 = min(c0 + per, slot.host_c1)
            spans.append((slot, c0, c1))
            edges.append(edges[-1] + c1 - c0)
    if not spans:
        return []
    offs = layout.host_col_offsets.index_select(0, torch.tensor(edges, dtype=torch.int64))  # in elements
    off = offs.tolist()
    # The host-owned runs cut at the chunk edges (runs.py ``cut_runs``: a run that column_runs
    # joined across chunks or matrices becomes one segment per chunk), then made relative to
    # each chunk's start and summed per chunk, over all chunks at once.
    cut = [p[0] for p in cut_runs([column_runs(~device_owned, layout.host_col_offsets)],
                                  [(off[i], off[i + 1] - off[i]) for i in range(len(spans))])]
    counts = [p.shape[0] for p in cut]
    seg = torch.cat(cut)
    chunk = torch.arange(len(spans)).repeat_interleave(torch.tensor(counts, dtype=torch.int64))
    held = torch.zeros(len(spans), dtype=torch.int64).index_add_(0, chunk, seg[:, 1])
    runs = torch.stack([seg[:, 0] - offs.index_select(0, chunk), seg[:, 1]], dim=1).split(counts)
    # 0: skipped (the device owns it all), 1: the host owns it all (runs None), 2: partly owned.
    some = held > 0
    kinds = (some.to(torch.int8) + (some & (held < offs[1:] - offs[:-1])).to(torch.int8)).tolist()
    return [Chunk(slot, c0, c1, off[i], runs[i] if k == 2 else None)
            for i, ((slot, c0, c1), k) in enumerate(zip(spans, kinds)) if k]


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
