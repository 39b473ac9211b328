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
* the host half (master, moments, gradient slots) of this rank's rows lives in this rank's host
  state: no host state is shared, no install is broadcast, no gradient is exchanged by zfctl.

HSDP (a 2-D mesh: replicate across nodes, shard within one; zfctl/train/fsdp.py): FSDP2 also
all-reduces the gradient shards across the replicas, so every replica holds the same rows'
gradients, and ``group`` is the shard dim's group only: the sums above run within a node.

Only the summation order of the scores, norm and masses differs from one process (partial sums
per rank), by rounding; a selection tie broken differently by that rounding is the one way the
ranks' columns could differ from one process's, and every rank still agrees (same summed vector).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from zfctl.offload.columns.selection import column_l1
from zfctl.offload.layout import ParamSlot, as_matrix


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
        self._handles: list[Any] = []  # hook_grads' hooks
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
        for i in range(len(self.local)):
            self.pull_grad(i)

    def pull_grad(self, index: int) -> None:
        """``pull_grads`` for one parameter."""
        g, local = self.dtensors[index].grad, self.local[index][1]
        local.grad = g.to_local() if isinstance(g, DTensor) else g

    def hook_grads(self, indices: list[int], on_grad: Callable[[int], None]) -> None:
        """Call ``on_grad(index)`` as soon as FSDP2 has reduced parameter ``index``'s gradient.

        FSDP2's ``foreach_reduce`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), run
        by each group's ``FSDPParamGroup.post_backward`` when that group's backward ends (a
        decoder layer's, then the root's from the end-of-backward callback), reduce-scatters the
        group's gradients (HSDP: then all-reduces them over the replicas), divides and casts them
        to the parameter dtype, assigns (or, a later micro-batch, adds into) each sharded
        parameter's ``.grad``, and then calls that DTensor's post-accumulate-grad hooks itself
        (autograd never sees the sharded parameter), inside ``stream(post_reduce_stream)``: the
        stream that wrote ``.grad``, so work the hook queues on the current stream is ordered
        after it. docs/design.md, "ZenFlow on FSDP2 shards", has the contract and the
        alternative that does not fit (``set_all_reduce_hook``)."""
        for i in indices:
            self._handles.append(self.dtensors[i].register_post_accumulate_grad_hook(
                lambda _p, i=i: on_grad(i)))

    def close(self) -> None:
        """Remove the ``hook_grads`` hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

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


# -- re-cutting a state across strategies and world sizes ------------------------------------------
# Every quantity of a ZenFlow state is per element of a column, or per column (the step counters),
# and FSDP2 ranks hold the same columns with 1/W of each column's elements each, in rank order
# (zfctl/train/fsdp.py: ZenFlow's row dim is the sharded dim, split evenly). So W ranks' states
# are one process's state cut along the elements of every column: re-cutting is concatenating or
# slicing, block by block on the device (layout.py: a block is [ncols, length]) and piece by piece
# on the host (pieces.py: a piece is [ncols, rows]). A one-process state is also what zero2 ranks
# of any world size load (pieces.merge_states gathers theirs into one), so fsdp <-> zero2 goes
# through it.

def _layout_of(sd: dict[str, Any]) -> Any:
    """The layout ``plan_layout`` gave the optimizer that saved ``sd`` (from its names and shapes)."""
    from zfctl.offload.layout import plan_layout

    named = [(n, torch.empty(s, device="meta")) for n, s in zip(sd["names"], sd["shapes"])]
    return plan_layout(named, float(sd["config"]["topk_ratio"]), frozenset(sd.get("by_row", [])))


def _row_dim(name: str, shape: list[int], by_row: set[str]) -> int:
    return 1 if name in by_row and len(shape) >= 2 else 0


def unshard_state(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One process's optimizer state from the ``state_dict``s of all ``W`` FSDP2 ranks (rank
    order): it loads into an unsharded optimizer, or, through ``shard_state``, into another W."""
    world = len(states)
    for r, sd in enumerate(states):
        if [int(x) for x in sd.get("fsdp_shard") or []] != [r, world]:
            raise ValueError(f"state {r} is not rank {r} of {world} FSDP2 shards: {sd.get('fsdp_shard')}")
        if sd["shapes"] != states[0]["shapes"]:
            raise ValueError("FSDP2 shards of unequal shapes cannot be re-cut (zfctl/train/fsdp.py check_shardable)")
    first, layout = states[0], _layout_of(states[0])
    rows = set(first.get("by_row", []))
    device = {k: torch.cat([torch.cat([sd["device"][k][b.off : b.off + b.ncols * b.length].view(b.ncols, b.length)
                                       for sd in states], dim=1).reshape(-1) for b in layout.blocks])
              if layout.blocks else first["device"][k] for k in ("master", "exp_avg", "exp_avg_sq")}
    device["steps"] = first["device"]["steps"]
    host = None
    if first.get("host") is not None:
        host = [{k: (v if k in ("name", "c0", "c1", "steps") else torch.cat([sd["host"][i][k] for sd in states], dim=1))
                 for k, v in piece.items()} for i, piece in enumerate(first["host"])]
    shapes = [[d * world if i == _row_dim(n, s, rows) else d for i, d in enumerate(s)]
              for n, s in zip(first["names"], first["shapes"])]
    out = {**first, "shapes": shapes, "device": device, "host": host}
    out.pop("fsdp_shard")
    return out


def shard_state(sd: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """``world`` FSDP2 ranks' states from one process's (``unshard_state``'s inverse; a zero2
    job's through ``pieces.merge_states``): rank r's are rows ``[r, r+1) x rows / world`` of
    every column."""
    if sd.get("fsdp_shard") is not None:
        raise ValueError("already an FSDP2 shard's state: unshard_state first")
    layout, rows = _layout_of(sd), set(sd.get("by_row", []))
    for s in layout.slots:
        if s.rows % world:
            raise ValueError(f"{s.name}: {s.rows} elements per column do not split over {world} ranks")
    out = []
    for r in range(world):
        def part(t: torch.Tensor, length: int, r: int = r) -> torch.Tensor:
            n = length // world
            return t[:, r * n : (r + 1) * n].contiguous()

        device = {k: torch.cat([part(sd["device"][k][b.off : b.off + b.ncols * b.length].view(b.ncols, b.length),
                                     b.length).reshape(-1) for b in layout.blocks])
                  if layout.blocks else sd["device"][k] for k in ("master", "exp_avg", "exp_avg_sq")}
        device["steps"] = sd["device"]["steps"]
        host = None
        if sd.get("host") is not None:
            host = [{k: (v if k in ("name", "c0", "c1", "steps") else part(v, v.shape[1])) for k, v in piece.items()}
                    for piece in sd["host"]]
        shapes = [[d // world if i == _row_dim(n, s, rows) else d for i, d in enumerate(s)]
                  for n, s in zip(sd["names"], sd["shapes"])]
        out.append({**sd, "shapes": shapes, "device": device, "host": host, "fsdp_shard": [r, world]})
    return out
