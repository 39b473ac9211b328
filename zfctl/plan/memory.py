"""Memory of a plan, line by line as the code allocates it, and whether a machine can hold it.

Every buffer that the engine, the checkpoint code and the data pipeline allocate in proportion to
the model is one line here, with its bytes and the code that allocates it (``MemoryItem.code``).
tests/plan/test_plan_memory.py builds the optimizer for real models and checks that the tensors it
holds add up to these lines within 2%, on every gradient path; scripts/memory_proof.py checks a
whole CPU run's peak RSS (checkpoint save and resume included) against them.

Notation: ``P`` all parameters, ``w`` bytes per model element (2 bf16/fp16, 4 fp32). Each matrix
is viewed as ``[rows, cols]`` (a by-row vocabulary matrix transposed, zfctl/offload/layout.py),
keeps ``k = num_selected(cols, topk_ratio)`` columns on the device and the rest on the host:
``H`` elements and ``Hc`` columns in the matrices with host columns, ``D`` device-owned elements
(the selected columns and every 1-D parameter) in ``Dc`` device columns, ``K`` of them (``Kc``
columns) the selected columns of the matrices with host columns.

host    process baseline               Python, torch, transformers, tokenizer, data; CUDA libraries
                                       (lines.py PROCESS_BASELINE: 0.45 GB, 2 GB with CUDA), per rank
device  CUDA context                   the context outside torch's allocator (CUDA_CONTEXT, 0.5 GB)
        weights               w P      the model, in train.precision
        gradients             w P      .grad of every param (freed after the step); with
                                       tuning.release_grads on the hook path (or topk_ratio 1), one
                                       process and no accumulation: w x (the largest matrix + the
                                       1-D params), each matrix's .grad freed in its hook
        selected state        16 D + 4 Dc  fp32 master, two moments and the gradient work buffer of
                                       the device columns, and a step counter per column
        gradient accumulator  4 H      accumulate=device: the interval's fp32 sum
        temporaries in flight          hook path on CUDA: transposed gradient chunks whose D2H runs
        exchange in flight    4 w M    W > 1 (zero2): two matrices' exchanges pending (M: the
                                       largest matrix), each its gathered send and received buffers
        install staging                CUDA: the device slots (model dtype) the install's H2D lands in
        activations           rough: 34 h w/2 bytes per token per layer + logits in fp32; with
                                       train.activation_checkpointing h w per token per layer + one
                                       layer's 34 h w/2 (recompute per layer) + the logits
host    fp32 master           4 H      page-locked on CUDA when the install DMAs from it
        upload buffer         w H      bf16/fp16 with zenflow.tuning.upload_buffer (auto: where the
                                       host holds it): the CPU AdamW's model-dtype copy of the host
                                       columns, what an install DMAs instead; page-locked on CUDA
        fp32 moments          8 H
        gradient slots        w H S n  grad_layout slots: a slot per step of an interval (S =
                                       update_interval, auto: auto_max_interval), n = 1 set, 2 with
                                       overlap_step when tuning.host_accumulators resolves to 2;
                                       page-locked on CUDA
        gradient carry        4 H      grad_layout carry: one fp32 sum, each landed chunk folded in
        landing ring          ring_slots x ring slot (model dtype)  grad_layout carry: where a chunk
                                       lands before its fold; page-locked on CUDA
        gradient accumulators 4 H      accumulate=device: each interval's fp32 sum lands here
                                       (no line for a checkpoint inside an interval: the save streams
                                       its partial sum; a resume under slots holds it as a 4 H carry
                                       for that interval, ``resume_carry``, a note)
        per-column bookkeeping 13 Hc   fp32 counter, owner flag, int64 column offset
        checkpoint I/O        64 MiB   while saving or resuming, streamed through one chunk
        selection staging     min(256 MiB, ~12 K) + min(cap, 12 K) + 32 Kc  a selection's column
                                       migration (one process or fsdp; zero2 ranks migrate by
                                       collectives): the in ring, the out buffer that holds the
                                       leaving state until the CPU worker writes it (16 K with
                                       release_grads' gradient; cap: tuning.staging_mb, auto: a
                                       quarter of the host's spare, 64 MiB-2 GiB: layouts.py
                                       grow_staging), the ids; page-locked on CUDA

Data parallel, ``W`` = distributed.nproc x distributed.nodes ranks, ``R`` = nproc per node: the
device lines are per GPU and the host lines per rank; ``node_host_total`` is ``R`` ranks' host
lines, what one node's RAM must hold. ``distributed.strategy`` decides the per-rank shares:

* ``zero2``: every GPU holds the whole model, its gradients and the selected state; each rank
  holds ``1/W`` of the host columns (zfctl/offload/parallel/partition.py), plus the exchange in flight;
* ``fsdp``: FSDP2 shards weights and gradients by row (zfctl/train/fsdp.py): each GPU holds
  ``1/W`` of them, of the selected state and of the host elements (every column of its rows, so
  the per-column bookkeeping is not divided), plus what FSDP2 gathers: the root's parameters
  (embeddings, head, final norm: kept from forward to backward) and two decoder layers (the
  current and the prefetched one), and one layer's unsharded gradients with their fp32 reduce copy;
  loading, the ranks of a node take turns building the whole model in host RAM and sharding it
  (zfctl/train/recipe.py), so ``node_host_total`` is at least one whole model plus the shards the
  earlier ranks keep (a note says it); with ``distributed.hsdp`` the shards are ``1/R``, not
  ``1/W`` (sharded within a node, every node holds a whole copy);
* ``auto``: ``fsdp`` when ``W > 1`` and the GPU cannot hold the ``zero2`` lines, else ``zero2``
  (``MemoryEstimate.strategy``).

Page-locked buffers are pinned at their exact size (zfctl/offload/device/pinned.py), so no line carries
the CUDA caching allocator's power-of-two rounding. ``zenflow.accumulate``,
``zenflow.tuning.grad_layout`` and ``zenflow.tuning.host_accumulators`` resolve here, together
(zfctl/plan/layouts.py ``choose``): the first of two slot sets, one, the fp32 carry and the
device accumulator (only within ``AUTO_DEVICE_SHARE`` of the GPU: the activation estimate is
rough, so the margin is wider than the verdict's) whose whole estimate fits the host and the
device, with notes; then ``upload_buffer`` and ``staging_mb`` take what is left.
zfctl/plan/settle.py writes the answers into the plan, once, for the plan's machine; the run
builds them (zfctl/train/optim.py) and only checks that its machine holds the plan
(zfctl/plan/holds.py).

The machine compared against is this one, or the target sizes of the plan's ``machine`` section
(``--gpu-memory``, ``--host-memory``; zfctl/plan/machine.py), so a laptop can plan the GPU run.
On a machine without CUDA the device side lives in host RAM too.
"""


from __future__ import annotations

from dataclasses import replace
from typing import Literal

# The engine's size rules are torch-free (zfctl/offload/sizing.py): `zfctl plan` loads no torch.
from zfctl.offload.sizing import AUTO_DEVICE_SHARE
from zfctl.plan.items import MemoryEstimate, MemoryItem
from zfctl.plan.layouts import choose, grow_staging
from zfctl.plan.lines import (
    ASSUMED_D2H_GBPS,
    CHECKPOINT_CHUNK,
    COLUMN_BYTES,
    CUDA_CONTEXT,
    PROCESS_BASELINE,
    _fill,
    process_lines,
)
from zfctl.plan.machine import GB, Machine, parse_size, target_machine
from zfctl.plan.schema import RunPlan
from zfctl.plan.sizes import (
    Counts,
    ModelSize,
    fsdp_shards,
    layout_counts,
    model_size,
    shard_shapes,
)
from zfctl.plan.verdict import DEVICE_MARGIN, HOST_RESERVE, _verdict, host_limit

# The lines (lines.py), the sizes (sizes.py) and the verdict (verdict.py) live in their own
# modules; this one assembles them. GB, Machine, parse_size and AUTO_DEVICE_SHARE are re-exported:
# estimate() takes a Machine and applies the share, so its callers (zfctl/cli/_common.py, tests)
# import them from here, as they import the sizes and the verdict's constants.
__all__ = ["ASSUMED_D2H_GBPS", "AUTO_DEVICE_SHARE", "CHECKPOINT_CHUNK", "COLUMN_BYTES", "CUDA_CONTEXT",
           "DEVICE_MARGIN", "GB", "HOST_RESERVE", "PROCESS_BASELINE", "Counts", "Machine", "MemoryEstimate", "MemoryItem", "ModelSize", "estimate",
           "fsdp_shards", "host_limit", "layout_counts", "model_size", "parse_size", "shard_shapes"]


def estimate(plan: RunPlan, machine: Machine | None = None, *, size: ModelSize | None = None) -> MemoryEstimate:
    """Memory of `plan`, line by line, against `machine` (default: the plan's target, else this
    one). ``size``: the model's, when known better than the plan says (a built hub model,
    zfctl/plan/sizes.py ``size_of_model``); default: from the plan (``model_size``). The
    gradient layout's ``auto`` fields are decided here (layouts.py ``choose``)."""
    machine = machine or target_machine(plan.machine)
    d = plan.distributed
    strategy = d.strategy
    if strategy == "auto":  # fsdp only where zero2's whole model per GPU does not fit
        zero2 = estimate(replace(plan, distributed=replace(d, strategy="zero2")), machine, size=size)
        device_short = any(r.startswith("device memory") for r in zero2.reasons)
        if d.nproc * d.nodes == 1 or not device_short:
            return zero2
        strategy = "fsdp"
    device_kind = (
        "cuda" if plan.train.device == "cuda" or (plan.train.device == "auto" and machine.cuda) else "cpu"
    )
    size = size if size is not None else model_size(plan)
    return choose(plan, machine, device_kind,
                  lambda p: _estimate(p, machine, size, strategy=strategy, device_kind=device_kind))


def _estimate(plan: RunPlan, machine: Machine, size: ModelSize | None, *, strategy: Literal["zero2", "fsdp"],
              device_kind: str) -> MemoryEstimate:
    """The estimate of a plan whose strategy and gradient layout are decided."""
    d, z = plan.distributed, plan.zenflow
    items: list[MemoryItem] = []
    notes: list[str] = []
    world, per_node = d.nproc * d.nodes, d.nproc
    room = 0.0
    if size is None:
        notes.append("model size unknown: set model.params_b (and model.arch) for an estimate")
    else:
        # First, so that the auto rules (layouts.py, the upload buffer) count what the process
        # holds before any buffer of the run.
        process_lines(items, device_kind)
        room = _fill(plan, size, items, notes, device_kind, machine, strategy=strategy)
    device_total, host_total, node_host = _totals(plan, items, device_kind, size, notes, strategy)
    master = sum(i.bytes for i in items if i.name == "fp32 master")
    slots = z.tuning.grad_layout == "slots" and z.accumulate == "host"
    resume = master if slots and z.update_interval != 1 else 0.0  # 4 B per host element (layouts.py resume_note)
    staging_mb = 2048.0 if z.tuning.staging_mb == "auto" else float(z.tuning.staging_mb)
    if z.tuning.staging_mb == "auto" and size is not None:  # what the host has to spare, after every other line
        staging_mb = grow_staging(plan, items, room, node_host, machine, per_node, resume)
        device_total, host_total, node_host = _totals(plan, items, device_kind, size, [], strategy)
    reasons = _verdict(items, device_kind, device_total, node_host, machine, plan.train.device, per_node,
                       baseline=per_node * PROCESS_BASELINE[device_kind])
    if strategy == "fsdp" and d.hsdp and world > 1:
        notes.append(f"distributed.hsdp: weights, gradients and optimizer state sharded over the {per_node} ranks "
                     f"of a node, each of the {d.nodes} nodes holding a whole copy")
    if d.strategy == "auto" and strategy == "fsdp":
        notes.append("distributed.strategy (auto): fsdp, the whole model per GPU (zero2) does not fit")
    return MemoryEstimate(size, items, device_total, host_total, device_kind, machine,
                          fits=size is not None and not reasons, reasons=reasons, notes=notes,
                          accumulate="device" if z.accumulate == "device" else "host",
                          host_accumulators=int(z.tuning.host_accumulators), strategy=strategy, world_size=world,
                          ranks_per_node=per_node, node_host_total=node_host,
                          upload_buffer=any(i.name == "upload buffer" for i in items),
                          grad_layout="carry" if z.tuning.grad_layout == "carry" else "slots",
                          staging_mb=staging_mb, resume_carry=resume)


def _totals(plan: RunPlan, items: list[MemoryItem], device_kind: str, size: ModelSize | None, notes: list[str],
            strategy: str) -> tuple[float, float, float]:
    """(device total, host total per rank, one node's host RAM) of ``items``; fsdp's model load
    may set the node's peak (a note says so)."""
    d = plan.distributed
    per_node = d.nproc
    device_total = sum(i.bytes for i in items if i.where == "device")
    host_total = sum(i.bytes for i in items if i.where == "host")
    node_host = per_node * (host_total + (device_total if device_kind == "cpu" else 0.0))
    if strategy == "fsdp" and d.nproc * d.nodes > 1 and size is not None:
        # zfctl/train/recipe.py: the ranks of a node take turns building the whole model in host
        # RAM and sharding it, before any optimizer state exists; the node's peak is the larger.
        load = (4 if plan.train.precision == "fp32" else 2) * size.params
        notes.append(f"fsdp model load: the {per_node} ranks of a node build the whole model in host RAM one "
                     f"at a time ({load / GB:.2f} GB, before the optimizer state exists), then keep their shards")
        node_host = max(node_host, per_node * PROCESS_BASELINE[device_kind] + load +
                        (per_node - 1) * load / fsdp_shards(plan))
    return device_total, host_total, node_host
