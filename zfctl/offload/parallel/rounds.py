"""The data-parallel exchange's plan (exchange.py): which columns go to which owner in which
round (``plan_rounds``), and the selected column ids each rank keeps on the host and the device.
Pure planning: no collective runs here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zfctl.offload.layout import Layout, ParamSlot
from zfctl.offload.parallel.partition import (
    BUCKET_BYTES,
    Partition,
)


@dataclass(frozen=True)
class Cols:
    """Columns ``ids`` (sorted int64, on the device) of one matrix: a unit of a round."""

    slot: ParamSlot
    ids: torch.Tensor

    @property
    def numel(self) -> int:
        return self.slot.rows * int(self.ids.numel())


Rounds = list[list[list[Cols]]]  # rounds[r][owner]: the columns owner receives in round r


def plan_rounds(part: Partition, layout: Layout, index: list[torch.Tensor | None], itemsize: int,
                device: torch.device) -> Rounds:
    """Each owner's non-selected host columns (``index``: selected column ids per slot, None: no
    selection), in slot order, cut into rounds of at most ``BUCKET_BYTES / W`` bytes per owner.

    Host work on the selected ids, with one D2H of all of them and one H2D of every unit's ids
    (``ids_to_host``, ``ids_to_device``): a copy per piece or per unit would be one stream sync
    each, several hundred at 7B. Called at selections and loads only (``GradExchange.replan``)."""
    cap = max(1, BUCKET_BYTES // part.world_size // itemsize)  # elements per owner per round
    host_index = ids_to_host(index)
    chunks: list[list[list[tuple[ParamSlot, torch.Tensor]]]] = [[[]] for _ in range(part.world_size)]
    sizes = [0] * part.world_size
    for pc in part.pieces:
        slot = layout.slots[pc.index]
        ids = torch.arange(pc.c0, pc.c1)
        sel = host_index[pc.index]
        if sel is not None:
            ids = ids[~torch.isin(ids, sel)]
        per = max(1, cap // slot.rows)  # whole columns per unit
        for a in range(0, len(ids), per):
            unit = (slot, ids[a : a + per])
            numel = slot.rows * len(unit[1])
            if sizes[pc.owner] and sizes[pc.owner] + numel > cap:
                chunks[pc.owner].append([])
                sizes[pc.owner] = 0
            chunks[pc.owner][-1].append(unit)
            sizes[pc.owner] += numel
    flat = [u for owner in chunks for rnd in owner for u in rnd]
    on_device = iter(ids_to_device([ids for _, ids in flat], device))
    cols = [[[Cols(slot, next(on_device)) for slot, _ in rnd] for rnd in owner] for owner in chunks]
    n = max(len(c) for c in cols)
    return [[c[r] if r < len(c) else [] for c in cols] for r in range(n)]


def ids_to_host(index: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The id tensors of ``index`` on the host, with one D2H copy for all of them (a blocking copy:
    one stream sync, at a selection or a load, not one per tensor)."""
    present = [i for i in index if i is not None]
    if not present:
        return list(index)
    flat = torch.cat([i.reshape(-1) for i in present]).to("cpu")  # sync point: one, for every matrix
    parts = iter(flat.split([i.numel() for i in present]))
    return [next(parts) if i is not None else None for i in index]


def ids_to_device(ids: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host id tensors on ``device`` with one H2D copy for all of them; on CUDA from page-locked
    memory with ``non_blocking`` (ordered on the compute stream before every kernel that reads
    them; the caching host allocator keeps the staging block until the copy is done)."""
    if not ids:
        return []
    flat = torch.cat(ids)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split([t.numel() for t in ids]))
