"""The plan's memory lines, one per buffer the code allocates (zfctl/plan/memory.py says what each is).

``_fill`` adds every line of a plan in the order ``zfctl plan`` prints them, for a plan whose
gradient layout is decided (``accumulate``, ``grad_layout``, ``host_accumulators``: layouts.py
``choose`` tries each and keeps the first that fits), resolving ``zenflow.tuning.upload_buffer``
on the way; ``_released_gradients`` bounds the ``gradients`` line where
``zenflow.tuning.release_grads`` applies. Split from zfctl/plan/memory.py by concern.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

# The engine's size rules, torch-free (zfctl/offload/sizing.py): `zfctl plan` loads no torch.
from zfctl.offload.sizing import (
    CHUNK_BYTES,
    OUT_BYTES,
    STAGE_BYTES,
    inflight_bytes,
    ring_slot_bytes,
    staging_bytes,
    staging_cap,
)
from zfctl.plan.items import MemoryItem, host_held
from zfctl.plan.layouts import layout_lines, staging_note
from zfctl.plan.machine import GB, Machine
from zfctl.plan.schema import RunPlan
from zfctl.plan.sizes import (
    Counts,
    ModelSize,
    _fsdp_gathered,
    _numel,
    fsdp_shards,
    layout_counts,
    shard_shapes,
)
from zfctl.plan.verdict import host_limit

CHECKPOINT_CHUNK = CHUNK_BYTES  # zfctl/train/checksum.py streams checkpoints through one chunk this size
ASSUMED_D2H_GBPS = 55.0  # the hook path measures its rate at start; the plan assumes an H100's pinned D2H
COLUMN_BYTES = 13  # per host column: fp32 step counter, bool owner flag, int64 element offset
# The process before any buffer of the run: Python, torch, transformers, the tokenizer and the
# prepared data, and with CUDA the host side of its libraries (cuBLAS, cuDNN, NCCL) and driver.
# CPU: scripts/memory_proof.py's runs peaked 0.44-0.47 GB above their lines (tiny-llama widened to
# hidden 768, 1 and 6 layers, alpaca-sample, torch 2.13 on this repo's 2-core VM); CUDA:
# a 6-layer 7B run (docs/design.md, "Defaults and the numbers behind them") held 31.9 GB against 29.9 GB of lines (an H200,
# torch 2.11 + CUDA 13). Constants, not a rule: the libraries' size does not scale with the model.
PROCESS_BASELINE = {"cpu": 0.45 * GB, "cuda": 2.0 * GB}
# The CUDA context on the device (kernels of torch and its libraries, driver state), outside
# torch's caching allocator, so no `torch.cuda.max_memory_reserved` sees it: 300-600 MB with
# CUDA 12/13's lazy module loading on an H100/H200; the plan takes 0.5 GB (not measured here).
CUDA_CONTEXT = 0.5 * GB



def process_lines(items: list[MemoryItem], device_kind: str) -> None:
    """The process's own memory, before any line of the run (``PROCESS_BASELINE``, ``CUDA_CONTEXT``):
    one host line per rank, and on CUDA the context on its GPU."""
    cuda = device_kind == "cuda"
    items.append(MemoryItem("host", "process baseline", PROCESS_BASELINE[device_kind],
                            "Python, torch, transformers, tokenizer, data" + (", CUDA libraries" if cuda else ""),
                            "the process (zfctl/plan/lines.py PROCESS_BASELINE)"))
    if cuda:
        items.append(MemoryItem("device", "CUDA context", CUDA_CONTEXT, "kernels and driver state, outside torch's "
                                "allocator", "the CUDA driver (zfctl/plan/lines.py CUDA_CONTEXT)"))


def _fill(plan: RunPlan, size: ModelSize, items: list[MemoryItem], notes: list[str], device_kind: str,
          machine: Machine, *, strategy: str) -> float:
    """Add the plan's lines, its gradient layout decided (``accumulate``, ``grad_layout``,
    ``host_accumulators``: layouts.py ``choose``); resolves ``upload_buffer``. Returns the bytes
    the selection's out buffer may still grow by under ``staging_mb: auto`` (lines.py places it
    at one packed piece; layouts.py ``grow_staging`` sizes it once the totals are known)."""
    t, z, d = plan.train, plan.zenflow, plan.data
    tu = z.tuning
    w = 4 if t.precision == "fp32" else 2
    r = float(z.topk_ratio)
    world = plan.distributed.nproc * plan.distributed.nodes
    fsdp = strategy == "fsdp" and world > 1
    shards = fsdp_shards(plan)
    whole = size
    if fsdp:  # this rank's shards: the layout ZenFlow plans for them (zfctl/offload/parallel/sharded.py)
        size = shard_shapes(size, shards, z.vocab_select == "rows")
    c = layout_counts(size, r, z.vocab_select == "rows")
    if world > 1 and not fsdp:  # zero2: 1/W of the host columns per rank (zfctl/offload/parallel/partition.py)
        c = replace(c, host=-(-c.host // world), host_cols=-(-c.host_cols // world))
    p = size.params
    cuda = device_kind == "cuda"

    def dev(name: str, nbytes: float, note: str, code: str) -> None:
        items.append(MemoryItem("device", name, float(nbytes), note, code))

    def host(name: str, nbytes: float, note: str, code: str) -> None:
        items.append(MemoryItem("host", name, float(nbytes), note, code))

    share = f", {'hsdp' if plan.distributed.hsdp else 'fsdp'}: 1/{shards} shard" if fsdp else ""
    dev("weights", w * p, f"{t.precision}, {p / 1e9:.3g}B params{share}", "the model (zfctl/train/models/load.py)")
    dev("gradients", w * p, f"{t.precision}, .grad of every param{share}", "autograd")
    if fsdp:
        root, layer = _fsdp_gathered(whole)
        dev("fsdp gathered parameters", w * (root + 2 * layer),
            f"the root's ({root / 1e6:.4g}M: embeddings, head, norm) and two layers' ({layer / 1e6:.4g}M each: "
            "current + prefetched)", "FSDP2 all-gather (zfctl/train/fsdp.py parallelize)")
        dev("fsdp layer gradients", (w + 4) * layer if w != 4 else 4 * layer,
            "one layer's unsharded gradients and their fp32 reduce-scatter copy",
            "FSDP2 reduce-scatter (MixedPrecisionPolicy reduce_dtype fp32)")
    dev("selected optimizer state", 16 * c.device + 4 * c.device_cols,
        f"fp32 master, moments, gradient buffer: topk_ratio {r:g} of columns + 1-D params",
        "zfctl/offload/device/device_adam.py DeviceAdam")
    if size.hidden and size.layers:
        tokens = t.micro_batch_size * d.max_length
        layer_acts = tokens * size.hidden * 34 * w / 2  # one decoder layer's saved activations
        if t.activation_checkpointing is True:
            # Each layer keeps its input (tokens x hidden x w); the backward recomputes one layer
            # at a time, so one layer's full activations exist at once on top.
            acts = size.layers * tokens * size.hidden * w + layer_acts
            how = "recompute per layer"
        else:
            acts = size.layers * layer_acts
            how = "no recompute"
        if size.vocab:
            acts += tokens * size.vocab * (w + 8)  # logits + fp32 upcast and its grad in the loss
        dev("activations (rough)", acts, f"micro_batch {t.micro_batch_size} x {d.max_length} tokens, {how}",
            "the model's forward/backward" + (" (train.activation_checkpointing)" if how != "no recompute" else ""))
    if c.host == 0:  # topk_ratio 1: nothing lives on the host
        _released_gradients(plan, size, items, w, hook=True)
        return 0.0

    choice = _accumulate(plan, c, items)
    pinned = " (page-locked, exact size)" if cuda and tu.pin_memory else ""
    want = int(tu.ring_slot_mb * 2**20)
    slot = ring_slot_bytes(want, tu.ring_slots, c.max_rows, c.host, w)
    # Page-locked while it is what an install DMAs; the upload buffer (_upload_buffer, below) takes
    # that over for bf16/fp16 where it fits (zfctl/offload/cpu/host.py install_source).
    host("fp32 master", 4 * c.host, "4 B per host-column element" + pinned, "zfctl/offload/cpu/host.py HostState.master")
    host("fp32 moments", 8 * c.host, "exp_avg + exp_avg_sq, 8 B per host-column element",
         "zfctl/offload/cpu/host.py HostState.exp_avg/exp_avg_sq")
    # The layout's lines (layouts.py). No line for a checkpoint inside an interval: the save
    # streams the partial sum into the file; a resume under slots holds it transiently (a note).
    layout_lines(plan, c.host, slot, items, pinned)
    host("per-column bookkeeping", COLUMN_BYTES * c.host_cols, "step counter, owner flag, column offset per column",
         "zfctl/offload/cpu/host.py, layout.py")
    if cuda:
        dev("install staging", tu.ring_slots * slot, f"{tu.ring_slots} x {slot / 2**20:.3g} MiB {t.precision} slots",
            "zfctl/offload/device/ring.py Ring.h2d")
    hook = choice == "host"  # fsdp too: FSDP2's hooks (zfctl/offload/parallel/sharded.py hook_grads)
    if hook:
        # The device temporaries' bound, as DuringBackward sets it (zfctl/offload/grads/device_to_host.py).
        budget = int(tu.inflight_mb * 2**20) if tu.inflight_mb else inflight_bytes(ASSUMED_D2H_GBPS)
        if not cuda and not tu.inflight_mb:
            budget = 4 * tu.ring_slots * slot
        budget = max(min(budget, w * c.host), 1)
        if not fsdp:  # fsdp: no release
            _released_gradients(plan, size, items, w, hook=True)
        if cuda:
            dev("gradient temporaries in flight", budget,
                "hook path: chunks whose D2H runs (zenflow.tuning.inflight_mb, or measured at start)",
                "zfctl/offload/grads/stream.py GradStream._make_room")
    if world > 1 and not fsdp:
        # exchange.py: a matrix's exchange holds its gathered send buffers (every host-path column,
        # the whole matrix before the first selection) and this rank's received share (at most the
        # whole matrix); the hook path keeps two pending (stream.py), so the two largest count.
        dev("gradient exchange in flight", 4 * w * c.largest,
            f"zero2 over {world} ranks: two pending exchanges of the largest matrix, "
            "send + receive",
            "zfctl/offload/parallel/exchange.py GradExchange.launch")
    host("checkpoint I/O", CHECKPOINT_CHUNK, "while saving or resuming: one streamed chunk",
         "zfctl/train/tensorfile.py")
    room = 0.0
    if 0 < r < 1 and c.selected and (world == 1 or fsdp):
        # zfctl/offload/columns/selector.py Selector._mover: made at the first selection, kept. A release
        # step's selection moves the gradient work buffer's columns too (release.py regather_pairs).
        # Its out buffer: as staging_mb says, or under auto one packed piece here, grown into what
        # the host has to spare once every line is known (layouts.py grow_staging).
        regather = hook and world == 1 and not fsdp and tu.release_grads and z.update_interval != "auto"
        pairs = 4 if regather else 3
        cap = STAGE_BYTES if tu.staging_mb == "auto" else staging_cap(tu.staging_mb)
        nbytes = staging_bytes(c.selected, c.selected_cols, c.max_rows, pairs, cap)
        if tu.staging_mb == "auto":
            room = float(staging_bytes(c.selected, c.selected_cols, c.max_rows, pairs, OUT_BYTES) - nbytes)
        host("selection staging", nbytes, staging_note(cap / 2**20, pinned), "zfctl/offload/columns/migration.py Mover")
    # Under slots a resume inside an interval holds a 4 B fp32 carry: the upload buffer and the
    # staging's growth leave room for it (layouts.py resume_fits).
    reserve = 4.0 * c.host if tu.grad_layout == "slots" and z.accumulate == "host" and z.update_interval != 1 else 0.0
    if w < 4 and not _upload_buffer(plan, float(w * c.host), items, notes, device_kind, machine, pinned, reserve):
        # no upload buffer: the install's device slots take the fp32 master's chunks, 4/w the bytes
        staging = next((i for i in items if i.name == "install staging"), None)
        if staging is not None:
            staging.bytes *= 4 // w
            staging.note = f"{tu.ring_slots} x {staging.bytes / tu.ring_slots / 2**20:.3g} MiB fp32 slots (the master's)"
    return room


def _upload_buffer(plan: RunPlan, nbytes: float, items: list[MemoryItem], notes: list[str], device_kind: str,
                   machine: Machine, pinned: str, reserve: float = 0.0) -> bool:
    """Resolve zenflow.tuning.upload_buffer for a bf16/fp16 model (auto: on when the host total with
    it, and ``reserve`` bytes kept free, stays within the verdict's limit, after the accumulators
    took theirs) and add its line; it, not the master, is then page-locked. Returns whether it is on."""
    choice = plan.zenflow.tuning.upload_buffer
    if choice == "auto":
        on = not machine.host_ram or host_held(items, device_kind) + nbytes + reserve <= host_limit(machine)
        notes.append(f"zenflow.tuning.upload_buffer (auto): {'on' if on else 'off'}; the CPU update's "
                     f"{plan.train.precision} copy of the host columns halves an install's PCIe bytes for "
                     f"{nbytes / GB:.2f} GB of host memory, {'used' if on else 'not used: it does not fit'}")
    else:
        on = bool(choice)
    if not on:
        return False
    next(i for i in items if i.name == "fp32 master").note = "4 B per host-column element"
    items.append(MemoryItem("host", "upload buffer", nbytes, f"the CPU AdamW's {plan.train.precision} copy of "
                            "the host columns, what an install moves" + pinned, "zfctl/offload/cpu/host.py HostState.upload"))
    return True


def _released_gradients(plan: RunPlan, size: ModelSize, items: list[MemoryItem], w: int, *, hook: bool) -> bool:
    """zenflow.tuning.release_grads (zfctl/offload/grads/release.py) where it bounds the ``gradients``
    line: the hook path (``hook``) in one process (``nproc x nodes`` = 1), a fixed update_interval,
    one micro-batch per step. Then at most one matrix's ``.grad`` lives at a time (the one whose hook runs) beside the
    1-D params' (not released), so the line becomes w x (the largest matrix + the 1-D params).
    Returns whether the release applies at all."""
    t, z = plan.train, plan.zenflow
    if not (hook and z.tuning.release_grads and z.update_interval != "auto"):
        return False
    # Every rank of the job counts, not this node's: nodes 2 x nproc 1 is data parallel too.
    if t.gradient_accumulation_steps > 1 or plan.distributed.nproc * plan.distributed.nodes > 1:
        why = ("earlier micro-batches accumulate into .grad" if t.gradient_accumulation_steps > 1 else
               "data parallel: selection steps all-reduce their scores from every .grad")
        _note(items, "gradients", f"{t.precision}, .grad of every param (release_grads: {why})")
        return True
    largest = max((_numel(shape) for _, shape in size.shapes if len(shape) > 1), default=0)
    if not largest:  # no shapes: the vocabulary matrix, or everything when even that is unknown
        largest = size.vocab * size.hidden if size.vocab and size.hidden else size.params
    dense = size.params - size.params_2d  # 1-D params: not released, tiny (zfctl/offload/grads/release.py)
    grads = next(i for i in items if i.name == "gradients")
    grads.bytes = float(w * (largest + dense))
    grads.note = f"{t.precision}, release_grads: one matrix's .grad at a time (the largest) + the 1-D params'"
    grads.code = "autograd, each .grad freed in its hook (zfctl/offload/grads/release.py)"
    return True


def _note(items: list[MemoryItem], name: str, note: str) -> None:
    next(i for i in items if i.name == name).note = note


def _accumulate(plan: RunPlan, c: Counts, items: list[MemoryItem]) -> Literal["host", "device"]:
    """``zenflow.accumulate`` as decided (layouts.py ``choose``), and the device path's line."""
    if plan.zenflow.accumulate != "device":
        return "host"
    items.append(MemoryItem("device", "gradient accumulator", 4.0 * c.host,
                            "zenflow.accumulate=device: fp32 interval sum, 4 B per host-column element",
                            "zfctl/offload/grads/device_acc.py DeviceAccumulator.buf"))
    return "device"
