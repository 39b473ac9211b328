"""``distributed.strategy: fsdp``: the model sharded with torch's FSDP2, applied the torchtitan way.

:func:`parallelize` wraps each decoder layer, then the root, with ``fully_shard``: a layer's
parameters are all-gathered just before its forward (and again for backward) and freed after,
and its gradients are reduce-scattered (averaged, in fp32) as soon as its backward ends, so a rank
holds ``1/W`` of the weights and gradients plus about two layers gathered (the current and the
prefetched one). Every weight is sharded on ZenFlow's row dim (zfctl/offload/parallel/sharded.py): dim 0,
except the vocabulary matrices ZenFlow reads by row (``zenflow.vocab_select: rows``), sharded on
dim 1, so every rank holds every column of its rows and selection needs one summed score vector.

:func:`check_shardable` is the refusal before anything is built: FSDP2 needs the layer list to
wrap, and zfctl needs every sharded dim to divide evenly (equal local rows on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

from zfctl.errors import ConfigError, RunFailed

if TYPE_CHECKING:
    from zfctl.plan.schema import RunPlan


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The repeated blocks FSDP2 wraps one by one: the ``nn.ModuleList`` holding the most
    parameters (``model.layers`` of Llama/Mistral/Qwen, ``transformer.h`` of GPT-2,
    ``decoder.layers`` of OPT); None for a model without one."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        return None
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def shard_dims(model: torch.nn.Module, by_row: Iterable[str]) -> dict[str, int]:
    """The dim each trainable parameter is sharded on (``parallelize``): ZenFlow's row dim."""
    rows = set(by_row)
    return {n: 1 if n in rows and p.dim() >= 2 else 0 for n, p in model.named_parameters() if p.requires_grad}


def check_shardable(model: torch.nn.Module, world_size: int, by_row: Iterable[str]) -> None:
    """Raise ``ConfigError`` (one line, the option to change) when FSDP2 cannot shard ``model``
    over ``world_size`` ranks the way ZenFlow needs: no decoder layer list to wrap, or a sharded
    dim that ``world_size`` does not divide."""
    if decoder_layers(model) is None:
        raise ConfigError("distributed.strategy", "fsdp",
                          f"{type(model).__name__} has no list of decoder layers for FSDP2 to wrap; "
                          "use distributed.strategy: zero2")
    params = dict(model.named_parameters())
    for name, dim in shard_dims(model, by_row).items():
        size = params[name].shape[dim]
        if size % world_size:
            raise ConfigError("distributed.nproc", world_size,
                              f"fsdp shards {name} (dim {dim} of size {size}) evenly over the ranks; "
                              "use a world size that divides it, or distributed.strategy: zero2")


def data_parallel_mesh(device_type: str, world_size: int, *, replicas: int = 1) -> DeviceMesh:
    """The mesh ``parallelize`` shards over: 1-D over every rank, or with ``replicas`` > 1 HSDP's
    2-D ``(replicate, shard)`` mesh: rows sharded over ``world_size / replicas`` consecutive ranks
    (one node under torchrun's rank order), each shard replicated ``replicas`` times (the nodes).
    The optimizer's ``shard_group`` is ``mesh.get_group("shard")`` for HSDP, the world otherwise."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicas == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    if world_size % replicas:
        raise ValueError(f"{world_size} ranks do not split into {replicas} replicas")
    return init_device_mesh(device_type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))


def hsdp_replicas(plan: RunPlan, world_size: int, local_world: int) -> int:
    """How many replicas :func:`data_parallel_mesh` makes for this run: with ``distributed.hsdp``
    the nodes torchrun actually launched (``world_size / LOCAL_WORLD_SIZE``), so that a resume of
    an HSDP run on one node shards over that node (flat fsdp); 1 otherwise."""
    if not plan.distributed.hsdp or world_size <= local_world or world_size % local_world:
        return 1
    return world_size // local_world


def shard_place(plan: RunPlan, strategy: str, rank: int, world_size: int, local_world: int) -> tuple[int, int]:
    """``rank``'s place (rank, size) among the pieces its optimizer state and model shard are cut
    into: under ``strategy`` fsdp the shard group of :func:`data_parallel_mesh` (HSDP: the ranks of
    its node, consecutive under torchrun), else the world. What a resume reads and verifies
    (world_size.py)."""
    if strategy != "fsdp":
        return rank, world_size
    size = world_size // hsdp_replicas(plan, world_size, local_world)
    return rank % size, size


def parallelize(model: torch.nn.Module, mesh: DeviceMesh, *, by_row: Iterable[str] = ()) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2 over ``mesh`` (``data_parallel_mesh``: 1-D, or HSDP's
    2-D replicate x shard): each decoder layer, then the root (embeddings, final norm, head).
    Gradients are reduced in fp32 whatever the model dtype (``MixedPrecisionPolicy``: the sum of W
    bf16 shards would lose bits); weights stay in the model dtype. Returns ``model`` (now an
    ``FSDPModule``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layer list (check_shardable)")
    dims = shard_dims(model, by_row)
    by_id = {id(p): dims.get(n, 0) for n, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)

    def placement(p: torch.nn.Parameter) -> Shard:
        return Shard(by_id.get(id(p), 0))

    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
    return model


def resolve_strategy(plan: RunPlan, world_size: int) -> Literal["zero2", "fsdp"]:
    """``distributed.strategy`` as this run trains it: ``auto`` is ``fsdp`` where the plan's
    estimate for its machine (``machine.*``, else this one's capacities, as `zfctl plan` showed
    it) says the whole model does not fit a GPU under ``zero2`` (zfctl/plan/memory.py). One
    process is ``zero2`` whatever the plan says (no group to shard over: a resume of an fsdp run
    on one process)."""
    s = plan.distributed.strategy
    if world_size == 1:  # nothing to shard over (a resume of an fsdp run on one process)
        return "zero2"
    if s != "auto":
        return s
    from zfctl.plan.memory import estimate

    return estimate(plan).strategy


def load_in_turns(local_rank: int, local_world: int, device: torch.device,
                  load: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``load()`` on every rank, the ranks of a node one after the other (``local_rank`` order):
    each turn builds the full model in host RAM and shards it (``parallelize`` in ``load``),
    which frees the full tensors, so a node's host peak holds one full model, not ``local_world``
    of them; the price is ``local_world`` loads in sequence. Every turn ends with one tiny
    all-reduce (every rank takes part, as a barrier): a rank whose load raised re-raises its
    error, the others one line naming it, instead of waiting for it in the next collective."""
    import torch.distributed as dist

    model: torch.nn.Module | None = None
    for turn in range(local_world):
        error: Exception | None = None
        if turn == local_rank:
            try:
                model = load()
            except Exception as e:  # noqa: BLE001 -- any failure: re-raised below, after the others learnt of it
                error = e
        failed = torch.tensor([float(error is not None)], device=device)  # on NCCL a device sync, once a turn
        dist.all_reduce(failed)
        if error is not None:
            raise error
        if failed.item():
            raise RunFailed(f"local rank {turn} could not load the model (its error is its own line)")
    assert model is not None
    return model

