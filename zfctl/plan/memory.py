"""Memory estimate of a plan, and whether this machine can hold it.

Byte counts per parameter (P = all params, P2 = params of 2-D weights, r = zenflow.topk_ratio,
w = 2 for bf16/fp16 and 4 for fp32):

device  weights           w * P        the model itself, in train.precision
        gradients         w * P        .grad of every param, same dtype (freed after the step)
        selected state    12 * (r*P2 + P1)  fp32 master + exp_avg + exp_avg_sq of the selected
                                       columns and of every 1-D param (ZenFlow keeps them on device)
        activations       rough: 34*h*w/2 bytes per token per layer (no recompute, fused
                          attention) + logits and their fp32 upcast for the loss
host    master+moments+accumulator 16 * P   fp32 master (4), exp_avg (4), exp_avg_sq (4), the
                                       interval's gradient accumulator (4): the CPU AdamW's state
        in-flight accumulator 4 * P   overlap_step: the worker reads last interval's mean while
                                       the device accumulates the next one
        pinned rings      2 * ring_slots * ring_slot_mb MiB (D2H gradients, H2D params)
        landing buffers   2 * w * P2   stream_grads with accumulate=host: the last backward's
                                       gradient columns land here (pinned), two steps alternate
device  gradient accumulator 4 * P2    accumulate=device: the interval's fp32 sum on the device

``zenflow.accumulate: auto`` resolves here: ``device`` when the device total with the accumulator
stays within ``AUTO_DEVICE_SHARE`` of the GPU's memory (the activation estimate is rough, so the
margin is wider than the verdict's), else ``host``. The choice is on the estimate
(``MemoryEstimate.accumulate``) and in a note, and the optimizer is built with it.

With topk_ratio 1 nothing lives on the host; on a machine without CUDA both sides live in host
RAM. Sizes are decimal GB (1e9 bytes), as GPU vendors and the ZenFlow paper quote them.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Literal

from zfctl.plan.schema import RunPlan

GB = 1e9
AUTO_DEVICE_SHARE = 0.85
_LLAMA_LIKE = {"llama", "mistral"}


@dataclass
class ModelSize:
    """Parameter counts and the shape numbers the activation estimate needs."""

    params: int
    params_2d: int
    hidden: int | None = None
    layers: int | None = None
    vocab: int | None = None


@dataclass
class MemoryItem:
    where: str  # "device" | "host"
    name: str
    bytes: float
    note: str = ""


@dataclass
class Machine:
    host_ram: float
    cuda: bool
    gpu_name: str = ""
    gpu_mem: float = 0.0


@dataclass
class MemoryEstimate:
    """The estimate: per-item bytes, totals, this machine, and a verdict with reasons."""

    size: ModelSize | None
    items: list[MemoryItem]
    device_total: float
    host_total: float
    device_kind: str  # "cuda" | "cpu": where the plan's device side would live here
    machine: Machine
    fits: bool
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    accumulate: Literal["host", "device"] = "host"  # zenflow.accumulate as resolved for this machine ("host" | "device")

    def to_dict(self) -> dict:
        return asdict(self)

    def item(self, name: str) -> float:
        """Bytes of the item called `name` (0 if absent)."""
        return sum(i.bytes for i in self.items if i.name == name)


def _llama_size(c: dict) -> ModelSize:
    """Exact parameter count of a Llama/Mistral-style config, without building it."""
    h, inter, layers, vocab = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["vocab_size"],
    )
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    mlp = 3 * h * inter
    emb = vocab * h
    head = 0 if c.get("tie_word_embeddings", True) else vocab * h
    two_d = emb + head + layers * (attn + mlp)
    one_d = layers * 2 * h + h  # two RMSNorms per layer + the final norm
    return ModelSize(two_d + one_d, two_d, h, layers, vocab)


def _built_size(c: dict) -> ModelSize:
    """Any transformers config: instantiate on the meta device (no memory, a few seconds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**c)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = list(model.parameters())
    return ModelSize(
        sum(p.numel() for p in params),
        sum(p.numel() for p in params if p.dim() == 2),
        getattr(cfg, "hidden_size", None),
        getattr(cfg, "num_hidden_layers", None),
        getattr(cfg, "vocab_size", None),
    )


def model_size(plan: RunPlan) -> ModelSize | None:
    """Counts from model.config (source=config) or model.params_b + model.arch; None if unknown."""
    m = plan.model
    if m.source == "config" and m.config:
        if m.config.get("model_type") in _LLAMA_LIKE:
            return _llama_size(m.config)
        return _built_size(m.config)
    if m.params_b:
        arch = m.arch or {}
        params = int(m.params_b * 1e9)
        h, layers = arch.get("hidden_size"), arch.get("num_hidden_layers")
        one_d = (2 * layers + 1) * h if h and layers else 0
        return ModelSize(params, params - one_d, h, layers, arch.get("vocab_size"))
    return None


def this_machine() -> Machine:
    """Host RAM and the first CUDA device, if any."""
    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 0.0
    import torch

    try:
        if torch.cuda.is_available():
            prop = torch.cuda.get_device_properties(0)
            return Machine(ram, True, prop.name, float(prop.total_memory))
    except RuntimeError as e:  # a broken CUDA driver must not break `zfctl plan`
        return Machine(ram, False, gpu_name=f"CUDA error: {e}")
    return Machine(ram, False)


def estimate(plan: RunPlan, machine: Machine | None = None) -> MemoryEstimate:
    """Estimate device and host memory of `plan` and compare with `machine` (default: this one)."""
    machine = machine or this_machine()
    device_kind = (
        "cuda" if plan.train.device == "cuda" or (plan.train.device == "auto" and machine.cuda) else "cpu"
    )
    size = model_size(plan)
    items: list[MemoryItem] = []
    notes: list[str] = []
    if size is None:
        notes.append("model size unknown: set model.params_b (and model.arch) for an estimate")
    else:
        _fill(plan, size, items)
    accumulate: Literal["host", "device"] = "host"
    if size is not None and float(plan.zenflow.topk_ratio) < 1.0:
        accumulate = _place_accumulator(plan, size, items, notes, device_kind, machine)
    device_total = sum(i.bytes for i in items if i.where == "device")
    host_total = sum(i.bytes for i in items if i.where == "host")
    reasons = _verdict(device_kind, device_total, host_total, machine, plan.train.device)
    return MemoryEstimate(
        size,
        items,
        device_total,
        host_total,
        device_kind,
        machine,
        fits=size is not None and not reasons,
        reasons=reasons,
        notes=notes,
        accumulate=accumulate,
    )


def _place_accumulator(plan: RunPlan, size: ModelSize, items: list[MemoryItem], notes: list[str],
                       device_kind: str, machine: Machine) -> Literal["host", "device"]:
    """Resolve zenflow.accumulate and add its memory: fp32 sum on the device, or landing buffers."""
    z = plan.zenflow
    nbytes = 4.0 * size.params_2d
    choice = z.accumulate
    if choice == "auto":
        device_total = sum(i.bytes for i in items if i.where == "device")
        fits = device_kind == "cuda" and machine.cuda and device_total + nbytes <= AUTO_DEVICE_SHARE * machine.gpu_mem
        choice = "device" if fits else "host"
    if choice == "device":
        items.append(MemoryItem("device", "gradient accumulator", nbytes,
                                "zenflow.accumulate=device: fp32 interval sum, 4 B per matrix element"))
    elif z.stream_grads:
        w = 4 if plan.train.precision == "fp32" else 2
        items.append(MemoryItem("host", "gradient landing buffers", 2.0 * w * size.params_2d,
                                "stream_grads: the last backward's gradient columns land here (pinned)"))
    how = "" if z.accumulate != "auto" else " (auto)"
    notes.append(f"zenflow.accumulate{how}: {choice}; the device accumulator costs {nbytes / GB:.2f} GB "
                 f"of device memory, {'used' if choice == 'device' else 'not used'}")
    return choice


def _fill(plan: RunPlan, size: ModelSize, items: list[MemoryItem]) -> None:
    t, z, d = plan.train, plan.zenflow, plan.data
    w = 4 if t.precision == "fp32" else 2
    p, p2 = size.params, size.params_2d
    p1 = p - p2
    r = float(z.topk_ratio)
    items.append(MemoryItem("device", "weights", w * p, f"{t.precision}, {p / 1e9:.3g}B params"))
    items.append(MemoryItem("device", "gradients", w * p, f"{t.precision}"))
    selected = p if r >= 1.0 else r * p2 + p1
    items.append(
        MemoryItem(
            "device",
            "selected optimizer state",
            12.0 * selected,
            f"fp32 master+moments, topk_ratio {r:g} of columns + 1-D params",
        )
    )
    if size.hidden and size.layers:
        tokens = t.micro_batch_size * d.max_length
        acts = size.layers * tokens * size.hidden * 34 * w / 2
        if size.vocab:
            acts += tokens * size.vocab * (w + 8)  # logits + fp32 upcast and its grad in the loss
        items.append(
            MemoryItem(
                "device",
                "activations (rough)",
                acts,
                f"micro_batch {t.micro_batch_size} x {d.max_length} tokens, no recompute",
            )
        )
    if r < 1.0:
        items.append(
            MemoryItem(
                "host",
                "master+moments+accumulator",
                16.0 * p,
                "fp32: 4 B master + 8 B moments + 4 B gradient accumulator per param",
            )
        )
        if z.overlap_step:
            items.append(
                MemoryItem(
                    "host",
                    "in-flight accumulator",
                    4.0 * p,
                    "overlap_step: the interval the CPU worker is updating",
                )
            )
        items.append(
            MemoryItem(
                "host",
                "pinned transfer rings",
                2 * z.ring_slots * z.ring_slot_mb * 2**20,
                f"2 rings x {z.ring_slots} slots x {z.ring_slot_mb:g} MiB",
            )
        )


def _verdict(
    device_kind: str, device_total: float, host_total: float, machine: Machine, requested: str
) -> list[str]:
    """Why this machine cannot run the plan ([] = it fits). Keeps 10% of RAM for the OS/Python."""
    reasons = []
    if requested == "cuda" and not machine.cuda:
        reasons.append("train.device is cuda but this machine has no CUDA device")
    if device_kind == "cuda" and machine.cuda and device_total > 0.95 * machine.gpu_mem:
        reasons.append(
            f"device memory: needs {device_total / GB:.1f} GB, {machine.gpu_name} has "
            f"{machine.gpu_mem / GB:.1f} GB"
        )
    host_need = host_total + (device_total if device_kind == "cpu" else 0.0)
    if machine.host_ram and host_need > 0.9 * machine.host_ram:
        reasons.append(
            f"host RAM: needs {host_need / GB:.1f} GB, this machine has {machine.host_ram / GB:.1f} GB"
        )
    return reasons
