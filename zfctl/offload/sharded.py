"""ZenFlow on FSDP2 shards (``distributed.strategy: fsdp``): each rank steps its local rows.

Under torch's FSDP2 (``fully_shard``, zfctl/train/fsdp.py) every parameter is a ``DTensor``
sharded on one dim over the group, and after backward its ``.grad`` is a ``DTensor`` holding this
rank's shard of the reduce-scattered (averaged) gradient. zfctl shards every weight on ZenFlow's
*row* dim (dim 0 of a ``[out, in]`` weight; dim 1 of a by-row vocabulary matrix, whose columns are
its dim-0 tokens, zfctl/offload/layout.py), so each rank holds all columns of some rows:

* the optimizer runs on the local shards (``to_local()`` views of the same storage, so an
  in-place update is what FSDP2 all-gathers next forward) exactly as in one process, with the
  same ``k`` per matrix (the column count is not sharded);
* a column's L1 score is a sum over rows, so the per-column scores of one matrix are the sum of
  every rank's local scores: one all-reduce of one vector per selectable matrix (concatenated)
  at a selection, and every rank ranks the same numbers and picks the same columns;
* the clip norm's sum of squares, and the auto interval's L1 masses, are sums over elements:
  one small all-reduce each;
* the host half (master, moments, accumulators) of this rank's rows lives in this rank's host
  state: no host state is shared, no install is broadcast, no gradient is exchanged by zfctl.

HSDP (a 2-D mesh: replicate across nodes, shard within one; zfctl/train/fsdp.py): FSDP2 also
all-reduces the gradient shards across the replicas, so every replica holds the same rows'
gradients, and ``group`` is the shard dim's group only: the sums above run within a node.

Only the summation order of the scores, norm and masses differs from one process (partial sums
per rank), by rounding; a selection tie broken differently by that rounding is the one way the
ranks' columns could differ from one process's, and every rank still agrees (same summed vector).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from zfctl.offload.layout import ParamSlot, as_matrix
from zfctl.offload.selection import column_l1


class ShardedParams:
    """The FSDP2 ``DTensor`` parameters of one optimizer and their local shards; ``group``: the
    ranks the rows are sharded over (the whole world, or HSDP's shard dim).

    ``local``: (name, tensor) pairs aliasing each shard's storage, what the engine plans and
    steps. ``by_row``: names of the matrices ZenFlow reads by row (their shard must be on dim 1).
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]], group: Any, by_row: frozenset[str]) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.dtensors: list[DTensor] = []
        self.local: list[tuple[str, torch.Tensor]] = []
        for name, p in named:
            if not isinstance(p, DTensor):
                raise TypeError(f"parameter {name!r} is not an FSDP2 DTensor: apply fully_shard to "
                                 "the whole model (zfctl/train/fsdp.py parallelize) before the optimizer")
            want = 1 if name in by_row and p.dim() >= 2 else 0
            if tuple(p.placements) not in ((Shard(want),), (Replicate(), Shard(want))):
                raise ValueError(f"parameter {name!r} is placed {tuple(p.placements)}; ZenFlow needs "
                                 f"Shard({want}) (its row dim), on a 1-D mesh or as HSDP's shard dim")
            with torch.no_grad():
                local = p.to_local().detach()  # the shard's storage: in-place writes reach FSDP2
            local.requires_grad_(True)
            self.dtensors.append(p)
            self.local.append((name, local))

    def pull_grads(self) -> None:
        """Point each local shard's ``.grad`` at its DTensor gradient's local shard (no copy)."""
        for p, (_, local) in zip(self.dtensors, self.local):
            g = p.grad
            local.grad = g.to_local() if isinstance(g, DTensor) else g

    def release_grads(self) -> None:
        """Drop the local references, so ``zero_grad`` frees the gradients."""
        for _, local in self.local:
            local.grad = None

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the shard group, in place (every rank gets the same bits)."""
        dist.all_reduce(t, group=self.group)
        return t

    def sum_of_squares(self, grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
        """The global gradient sum of squares (fp32, 0-dim): local squares, one all-reduce."""
        present = [g for g in grads if g is not None]
        sq = torch.zeros((), device=device)
        if present:
            sq = torch.stack(torch._foreach_norm(present, 2.0, dtype=torch.float32)).square().sum()
        return self.all_sum(sq.reshape(1)).reshape(())

    def column_scores(self, grads: list[torch.Tensor | None], slots: list[ParamSlot],
                      device: torch.device) -> list[torch.Tensor]:
        """Per-column L1 scores of each slot's whole matrix: each rank's rows' scores, summed over
        the group as one concatenated vector (4 B per column of every selectable matrix)."""
        parts = []
        for s in slots:
            g = grads[s.index]
            parts.append(column_l1(as_matrix(g, s)) if g is not None else torch.zeros(s.cols, device=device))
        flat = self.all_sum(torch.cat(parts))
        return list(flat.split([s.cols for s in slots]))

    def sum_list(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """0-dim tensors summed over the group with one all-reduce."""
        if not values:
            return values
        return list(self.all_sum(torch.stack(values)).unbind())
