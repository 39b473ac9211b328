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
(the selected columns and every 1-D parameter) in ``Dc`` device columns.

device  weights               w P      the model, in train.precision
        gradients             w P      .grad of every param (freed after the step); with
                                       tuning.release_grads on the hook path (or topk_ratio 1), one
                                       process and no accumulation: w x (the largest matrix + the
                                       1-D params), each matrix's .grad freed in its hook
        selected state        16 D + 4 Dc  fp32 master, two moments and the gradient work buffer of
                                       the device columns, and a step counter per column
        gradient accumulator  4 H      accumulate=device: the interval's fp32 sum
        temporaries in flight          hook path on CUDA: transposed gradient chunks whose D2H runs
        exchange in flight    4 w M    distributed.nproc > 1: two matrices' exchanges pending (M: the
                                       largest matrix), each its gathered send and received buffers
        install staging                CUDA: the device slots the install's H2D lands in
        activations           rough: 34 h w/2 bytes per token per layer + logits in fp32; with
                                       train.activation_checkpointing h w per token per layer + one
                                       layer's 34 h w/2 (recompute per layer) + the logits
host    fp32 master           4 H      page-locked on CUDA (the install DMAs from it)
        fp32 moments          8 H
        gradient slots        w H S n  host paths: a slot per step of an interval (S = update_interval,
                                       auto: auto_max_interval), n = 1 set, 2 with overlap_step when
                                       tuning.host_accumulators resolves to 2; page-locked on CUDA
        checkpoint interval sum 4 H    host paths, a checkpoint saved or resumed inside an interval
        gradient accumulators 4 H      accumulate=device: each interval's fp32 sum lands here
        per-column bookkeeping 13 Hc   fp32 counter, owner flag, int64 column offset
        checkpoint I/O        64 MiB   while saving or resuming, streamed through one chunk
        selection staging     min(64 MiB, 4 M)  a selection's column migration (one process or
                                       fsdp; zero2 ranks migrate by collectives), page-locked on CUDA

Data parallel, ``W`` = distributed.nproc x distributed.nodes ranks, ``R`` = nproc per node: the
device lines are per GPU and the host lines per rank; ``node_host_total`` is ``R`` ranks' host
lines, what one node's RAM must hold. ``distributed.strategy`` decides the per-rank shares:

* ``zero2``: every GPU holds the whole model, its gradients and the selected state; each rank
  holds ``1/W`` of the host columns (zfctl/offload/partition.py), plus the exchange in flight;
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

Page-locked buffers are pinned at their exact size (zfctl/offload/pinned.py), so no line carries
the CUDA caching allocator's power-of-two rounding. ``zenflow.accumulate: auto`` resolves here:
``device`` when the device total with the accumulator stays within ``AUTO_DEVICE_SHARE`` of the
GPU's memory (the activation estimate is rough, so the margin is wider than the verdict's), else
``host``. The choice is on the estimate (``MemoryEstimate.accumulate``) and in a note, and the
optimizer is built with it. ``zenflow.tuning.host_accumulators: auto`` resolves here the same way
(``MemoryEstimate.host_accumulators``, zfctl/train/optim.py builds with it): with
``overlap_step`` on a host path, 2 slot sets when the host total with the second set stays within
what the verdict lets the host use, else 1.

The machine compared against is this one, or the target sizes of the plan's ``machine`` section
(``--gpu-memory``, ``--host-memory``; zfctl/plan/machine.py), so a laptop can plan the GPU run.
On a machine without CUDA the device side lives in host RAM too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from zfctl.offload.bandwidth import inflight_bytes
from zfctl.offload.device_acc import AUTO_DEVICE_SHARE, device_fits
from zfctl.offload.device_to_host import slots_per_set
from zfctl.offload.layout import num_selected
from zfctl.offload.ring import ring_slot_bytes
from zfctl.offload.selection import STAGE_BYTES
from zfctl.plan.machine import GB, Machine, parse_size, target_machine
from zfctl.plan.schema import RunPlan
from zfctl.train.checksum import CHUNK_BYTES

# GB, Machine, parse_size and AUTO_DEVICE_SHARE are re-exported: estimate() takes a Machine and
# applies the share, so its callers (zfctl/cli/_common.py, tests) import them from here too.
__all__ = ["AUTO_DEVICE_SHARE", "GB", "Counts", "Machine", "MemoryEstimate", "MemoryItem", "ModelSize",
           "estimate", "host_limit", "layout_counts", "model_size", "parse_size"]

DEVICE_MARGIN = 0.05  # the verdict keeps 5% of the GPU for the allocator's fragmentation
HOST_RESERVE = 15 * GB  # left for the OS, the page cache, data and Python (a quarter of a smaller machine)
CHECKPOINT_CHUNK = CHUNK_BYTES  # zfctl/train/checksum.py streams checkpoints through one chunk this size
ASSUMED_D2H_GBPS = 55.0  # the hook path measures its rate at start; the plan assumes an H100's pinned D2H
COLUMN_BYTES = 13  # per host column: fp32 step counter, bool owner flag, int64 element offset
_LLAMA_LIKE = {"llama", "mistral"}


@dataclass
class ModelSize:
    """Parameter counts, the shapes the exact lines need, and the numbers activations need.

    ``shapes``: every trainable parameter's (name, shape), when known (a config, or a built
    model); ``vocab``names: the token-indexed matrices among them (split by row under
    ``zenflow.vocab_select: rows``). Without shapes (a hub model known by ``params_b``), the lines
    use ``params_2d`` as the host elements, an approximation.
    """

    params: int
    params_2d: int
    hidden: int | None = None
    layers: int | None = None
    vocab: int | None = None
    shapes: list[tuple[str, tuple[int, ...]]] = field(default_factory=list, repr=False)
    vocab_names: list[str] = field(default_factory=list, repr=False)


@dataclass
class MemoryItem:
    where: str  # "device" | "host"
    name: str
    bytes: float
    note: str = ""
    code: str = ""  # what allocates it


@dataclass
class MemoryEstimate:
    """The estimate: per-item bytes, totals, the machine, and a verdict with reasons."""

    size: ModelSize | None
    items: list[MemoryItem]
    device_total: float
    host_total: float
    device_kind: str  # "cuda" | "cpu": where the plan's device side would live
    machine: Machine
    fits: bool
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    accumulate: Literal["host", "device"] = "host"  # zenflow.accumulate as resolved for the machine
    strategy: Literal["zero2", "fsdp"] = "zero2"  # distributed.strategy as resolved (auto: module docstring)
    world_size: int = 1
    ranks_per_node: int = 1
    node_host_total: float = 0.0  # ranks_per_node x the per-rank host lines (and, without CUDA, device lines)
    host_accumulators: int = 1  # zenflow.tuning.host_accumulators as resolved for the machine

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["size"] is not None:  # the per-parameter shapes are an input, not a result
            d["size"].pop("shapes")
            d["size"].pop("vocab_names")
        return d

    def item(self, name: str) -> float:
        """Bytes of the item called `name` (0 if absent)."""
        return sum(i.bytes for i in self.items if i.name == name)


def _llama_size(c: dict) -> ModelSize:
    """Exact parameter shapes of a Llama/Mistral-style config, without building it."""
    h, inter, layers, vocab = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["vocab_size"],
    )
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    tied = c.get("tie_word_embeddings", True)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (heads * hd, h)), (p + "self_attn.k_proj.weight", (kv * hd, h)),
                   (p + "self_attn.v_proj.weight", (kv * hd, h)), (p + "self_attn.o_proj.weight", (h, heads * hd)),
                   (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                   (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                   (p + "post_attention_layernorm.weight", (h,))]
    shapes.append(("model.norm.weight", (h,)))
    vocab_names = ["model.embed_tokens.weight"]
    if not tied:
        shapes.append(("lm_head.weight", (vocab, h)))
        vocab_names.append("lm_head.weight")
    params = sum(_numel(s) for _, s in shapes)
    two_d = sum(_numel(s) for _, s in shapes if len(s) == 2)
    return ModelSize(params, two_d, h, layers, vocab, shapes, vocab_names)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _built_size(c: dict) -> ModelSize:
    """Any transformers config: instantiate on the meta device (no memory, a few seconds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zfctl.offload.layout import vocab_matrices

    cfg = AutoConfig.for_model(**c)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return ModelSize(
        sum(_numel(s) for _, s in named),
        sum(_numel(s) for _, s in named if len(s) == 2),
        getattr(cfg, "hidden_size", None),
        getattr(cfg, "num_hidden_layers", None),
        getattr(cfg, "vocab_size", None),
        named,
        vocab_matrices(model),
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


@dataclass
class Counts:
    """The layout's sizes (zfctl/offload/layout.py ``plan_layout``), from shapes alone."""

    host: int  # H: elements of matrices with host columns
    host_cols: int  # Hc
    device: int  # D: device-owned elements once selected (selected columns + 1-D params)
    device_cols: int  # Dc
    max_rows: int  # the tallest host column (the ring slot must hold one)
    largest: int = 0  # M: elements of the largest matrix with host columns (the exchange's transient)


def layout_counts(size: ModelSize, topk_ratio: float, by_row: bool) -> Counts:
    """H, Hc, D, Dc as ``plan_layout`` assigns them; approximated from ``params_2d`` without shapes."""
    if not size.shapes:
        p1 = size.params - size.params_2d
        host = size.params_2d if topk_ratio < 1.0 else 0
        rows = size.hidden or 1
        device = (size.params_2d if topk_ratio >= 1.0 else int(topk_ratio * size.params_2d)) + p1
        largest = (size.vocab or 0) * rows if host else 0  # the vocabulary matrix, when known
        return Counts(host, host // rows, device, device // rows, rows, largest)
    c = Counts(0, 0, 0, 0, 0)
    rowwise = set(size.vocab_names) if by_row else set()
    for name, shape in size.shapes:
        numel = _numel(shape)
        if len(shape) <= 1:  # dense: one device column of numel elements
            c.device += numel
            c.device_cols += 1
            continue
        rows, cols = shape[0], numel // shape[0]
        if name in rowwise:
            rows, cols = cols, rows
        k = num_selected(cols, topk_ratio)
        c.device += k * rows
        c.device_cols += k
        if k < cols:
            c.host += rows * cols
            c.host_cols += cols
            c.max_rows = max(c.max_rows, rows)
            c.largest = max(c.largest, rows * cols)
    return c


def estimate(plan: RunPlan, machine: Machine | None = None) -> MemoryEstimate:
    """Memory of `plan`, line by line, against `machine` (default: the plan's target, else this one)."""
    machine = machine or target_machine(plan.machine)
    d = plan.distributed
    strategy = d.strategy
    if strategy == "auto":  # fsdp only where zero2's whole model per GPU does not fit
        zero2 = estimate(replace(plan, distributed=replace(d, strategy="zero2")), machine)
        device_short = any(r.startswith("device memory") for r in zero2.reasons)
        if d.nproc * d.nodes == 1 or not device_short:
            return zero2
        strategy = "fsdp"
    device_kind = (
        "cuda" if plan.train.device == "cuda" or (plan.train.device == "auto" and machine.cuda) else "cpu"
    )
    size = model_size(plan)
    items: list[MemoryItem] = []
    notes: list[str] = []
    accumulate: Literal["host", "device"] = "host"
    world, per_node = d.nproc * d.nodes, d.nproc
    n_acc = 1
    if size is None:
        notes.append("model size unknown: set model.params_b (and model.arch) for an estimate")
    else:
        accumulate, n_acc = _fill(plan, size, items, notes, device_kind, machine, strategy=strategy)
    device_total = sum(i.bytes for i in items if i.where == "device")
    host_total = sum(i.bytes for i in items if i.where == "host")
    node_host = per_node * (host_total + (device_total if device_kind == "cpu" else 0.0))
    if strategy == "fsdp" and world > 1 and size is not None:
        # zfctl/train/recipe.py: the ranks of a node take turns building the whole model in host
        # RAM and sharding it, before any optimizer state exists; the node's peak is the larger.
        load = (4 if plan.train.precision == "fp32" else 2) * size.params
        notes.append(f"fsdp model load: the {per_node} ranks of a node build the whole model in host RAM one "
                     f"at a time ({load / GB:.2f} GB, before the optimizer state exists), then keep their shards")
        node_host = max(node_host, load + (per_node - 1) * load / fsdp_shards(plan))
    reasons = _verdict(items, device_kind, device_total, node_host, machine, plan.train.device, per_node)
    if strategy == "fsdp" and d.hsdp and world > 1:
        notes.append(f"distributed.hsdp: weights, gradients and optimizer state sharded over the {per_node} ranks "
                     f"of a node, each of the {d.nodes} nodes holding a whole copy")
    if d.strategy == "auto" and strategy == "fsdp":
        notes.append("distributed.strategy (auto): fsdp, the whole model per GPU (zero2) does not fit")
    return MemoryEstimate(size, items, device_total, host_total, device_kind, machine,
                          fits=size is not None and not reasons, reasons=reasons, notes=notes,
                          accumulate=accumulate, host_accumulators=n_acc, strategy=strategy, world_size=world, ranks_per_node=per_node,
                          node_host_total=node_host)


def fsdp_shards(plan: RunPlan) -> int:
    """The ranks FSDP2 shards a weight over: nproc x nodes, or with ``distributed.hsdp`` the
    nproc ranks of one node (every node holds a whole copy: zfctl/train/fsdp.py)."""
    d = plan.distributed
    return d.nproc if d.hsdp else d.nproc * d.nodes


def shard_shapes(size: ModelSize, world: int, by_row: bool) -> ModelSize:
    """One FSDP2 rank's share of ``size``: every shape with its ZenFlow row dim (dim 0; dim 1 of a
    by-row vocabulary matrix, zfctl/train/fsdp.py) divided by ``world``, rounded up as FSDP2 pads."""
    rowwise = set(size.vocab_names) if by_row else set()

    def local(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        dim = 1 if name in rowwise and len(shape) >= 2 else 0
        return tuple(-(-n // world) if i == dim else n for i, n in enumerate(shape))

    shapes = [(n, local(n, s)) for n, s in size.shapes]
    if not shapes:  # counts only: an even split
        return replace(size, params=-(-size.params // world), params_2d=-(-size.params_2d // world))
    return replace(size, params=sum(_numel(s) for _, s in shapes),
                   params_2d=sum(_numel(s) for _, s in shapes if len(s) == 2), shapes=shapes)


def _fsdp_gathered(size: ModelSize) -> tuple[int, int]:
    """(elements of the root's own parameters, of the largest decoder layer): what FSDP2 gathers."""
    if not size.shapes:
        layer = (size.params - (2 * (size.vocab or 0) * (size.hidden or 0))) // max(1, size.layers or 1)
        return size.params - layer * (size.layers or 1), layer
    layers: dict[str, int] = {}
    root = 0
    for name, shape in size.shapes:
        parts = name.split(".")
        idx = next((i for i, x in enumerate(parts[:-1]) if x.isdigit()), None)
        if idx is None:
            root += _numel(shape)
        else:
            key = ".".join(parts[: idx + 1])
            layers[key] = layers.get(key, 0) + _numel(shape)
    return root, max(layers.values(), default=0)


def _fill(plan: RunPlan, size: ModelSize, items: list[MemoryItem], notes: list[str], device_kind: str,
          machine: Machine, *, strategy: str) -> tuple[Literal["host", "device"], int]:
    """Add the plan's lines; returns the resolved ``accumulate`` and host accumulator count."""
    t, z, d = plan.train, plan.zenflow, plan.data
    tu = z.tuning
    w = 4 if t.precision == "fp32" else 2
    r = float(z.topk_ratio)
    world = plan.distributed.nproc * plan.distributed.nodes
    fsdp = strategy == "fsdp" and world > 1
    shards = fsdp_shards(plan)
    whole = size
    if fsdp:  # this rank's shards: the layout ZenFlow plans for them (zfctl/offload/sharded.py)
        size = shard_shapes(size, shards, z.vocab_select == "rows")
    c = layout_counts(size, r, z.vocab_select == "rows")
    if world > 1 and not fsdp:  # zero2: 1/W of the host columns per rank (zfctl/offload/partition.py)
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
        "zfctl/offload/device_adam.py DeviceAdam")
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
        return "host", 1

    choice = _accumulate(plan, c, items, device_kind, machine)
    pinned = " (page-locked, exact size)" if cuda and tu.pin_memory else ""
    host("fp32 master", 4 * c.host, "4 B per host-column element" + pinned, "zfctl/offload/host.py HostState.master")
    host("fp32 moments", 8 * c.host, "exp_avg + exp_avg_sq, 8 B per host-column element",
         "zfctl/offload/host.py HostState.exp_avg/exp_avg_sq")
    if choice == "device":
        host("gradient accumulators", 4 * c.host, "1 x fp32: the device path lands each interval's sum here once" +
             pinned, "zfctl/offload/slots.py GradSlots (sum_buffer)")
    else:  # one set here; its count and note are resolved once every line exists (below)
        per = slots_per_set(z)
        host("gradient slots", per * w * c.host, f"{per} x {t.precision} slots (one per step of an interval)" +
             pinned, "zfctl/offload/slots.py GradSlots")
        host("checkpoint interval sum", 4 * c.host, "a checkpoint saved or resumed inside an interval: its fp32 sum",
             "zfctl/offload/slots.py GradSlots.partial_sum, carry")
    host("per-column bookkeeping", COLUMN_BYTES * c.host_cols, "step counter, owner flag, column offset per column",
         "zfctl/offload/host.py, layout.py")
    want = int(tu.ring_slot_mb * 2**20)
    slot = ring_slot_bytes(want, tu.ring_slots, c.max_rows, c.host, w)
    h2d_slot = slot * 4 // w
    if cuda:
        dev("install staging", tu.ring_slots * h2d_slot, f"{tu.ring_slots} x {h2d_slot / 2**20:.3g} MiB fp32 slots",
            "zfctl/offload/ring.py Ring.h2d")
    hook = tu.stream_grads and choice == "host"  # fsdp too: FSDP2's hooks (zfctl/offload/sharded.py hook_grads)
    if hook:
        # The device temporaries' bound, as DuringBackward sets it (zfctl/offload/device_to_host.py).
        budget = int(tu.inflight_mb * 2**20) if tu.inflight_mb else inflight_bytes(ASSUMED_D2H_GBPS)
        if not cuda and not tu.inflight_mb:
            budget = 4 * tu.ring_slots * slot
        budget = max(min(budget, w * c.host), 1)
        if not fsdp:  # fsdp: no release
            _released_gradients(plan, size, items, w, hook=True)
        if cuda:
            dev("gradient temporaries in flight", budget,
                "hook path: chunks whose D2H runs (zenflow.tuning.inflight_mb, or measured at start)",
                "zfctl/offload/stream.py GradStream._make_room")
    if world > 1 and not fsdp:
        # exchange.py: a matrix's exchange holds its gathered send buffers (every host-path column,
        # the whole matrix before the first selection) and this rank's received share (at most the
        # whole matrix); the hook path keeps two pending (stream.py), so the two largest count.
        dev("gradient exchange in flight", 4 * w * c.largest,
            f"zero2 over {world} ranks: two pending exchanges of the largest matrix, "
            "send + receive",
            "zfctl/offload/exchange.py GradExchange.launch")
    host("checkpoint I/O", CHECKPOINT_CHUNK, "while saving or resuming: one streamed chunk",
         "zfctl/train/tensorfile.py")
    if 0 < r < 1 and c.largest and (world == 1 or fsdp):
        # zfctl/offload/selector.py Selector._staging: made at the first selection, kept.
        host("selection staging", min(STAGE_BYTES, 4 * c.largest), "a selection's column migration" + pinned,
             "zfctl/offload/selection.py Staging")
    how = "" if z.accumulate != "auto" else " (auto)"
    notes.append(f"zenflow.accumulate{how}: {choice}; the device accumulator costs {4 * c.host / GB:.2f} GB "
                 f"of device memory, {'used' if choice == 'device' else 'not used'}")
    n_acc = 1
    if choice == "host":
        n_acc = _host_accumulators(plan, next(i.bytes for i in items if i.name == "gradient slots"), items, notes,
                                   device_kind, machine)
    return choice, n_acc


def _host_accumulators(plan: RunPlan, nbytes: float, items: list[MemoryItem], notes: list[str], device_kind: str,
                       machine: Machine) -> int:
    """Resolve zenflow.tuning.host_accumulators on a host path: the gradient slot sets (auto: 2
    when the host total with the second set, ``nbytes``, stays within the verdict's limit) and
    write the count into its line."""
    z = plan.zenflow
    line = next(i for i in items if i.name == "gradient slots")
    per, pin = slots_per_set(z), " (page-locked, exact size)" if "page-locked" in line.note else ""
    if not z.overlap_step:
        line.note = f"1 set of {per} slots: one interval (the step waits for the CPU update)" + pin
        return 1
    choice = z.tuning.host_accumulators
    if choice == "auto":
        held = sum(i.bytes for i in items if i.where == "host" or device_kind == "cpu")  # as _verdict counts
        need = held + nbytes
        n = 2 if not machine.host_ram or need <= host_limit(machine) else 1
        notes.append(f"zenflow.tuning.host_accumulators (auto): {n}; a second set of gradient slots costs "
                     f"{nbytes / GB:.2f} GB of host memory, {'used' if n == 2 else 'not used: it does not fit'}")
    else:
        n = int(choice)
    line.bytes = nbytes * n
    line.note = (f"2 sets of {per} slots: overlap_step: the next interval lands in one while the CPU update reads "
                 "the other" if n == 2 else f"1 set of {per} slots: overlap_step: the next interval's writes wait "
                 "for the CPU update to have read each chunk") + pin
    return n


def _released_gradients(plan: RunPlan, size: ModelSize, items: list[MemoryItem], w: int, *, hook: bool) -> bool:
    """zenflow.tuning.release_grads (zfctl/offload/release.py) where it bounds the ``gradients``
    line: the hook path (``hook``) in one process, a fixed update_interval, one micro-batch per
    step. Then at most one matrix's ``.grad`` lives at a time (the one whose hook runs) beside the
    1-D params' (not released), so the line becomes w x (the largest matrix + the 1-D params).
    Returns whether the release applies at all."""
    t, z = plan.train, plan.zenflow
    if not (hook and z.tuning.release_grads and z.update_interval != "auto"):
        return False
    if t.gradient_accumulation_steps > 1 or plan.distributed.nproc > 1:
        why = ("earlier micro-batches accumulate into .grad" if t.gradient_accumulation_steps > 1 else
               "data parallel: selection steps all-reduce their scores from every .grad")
        _note(items, "gradients", f"{t.precision}, .grad of every param (release_grads: {why})")
        return True
    largest = max((_numel(shape) for _, shape in size.shapes if len(shape) > 1), default=0)
    if not largest:  # no shapes: the vocabulary matrix, or everything when even that is unknown
        largest = size.vocab * size.hidden if size.vocab and size.hidden else size.params
    dense = size.params - size.params_2d  # 1-D params: not released, tiny (zfctl/offload/release.py)
    grads = next(i for i in items if i.name == "gradients")
    grads.bytes = float(w * (largest + dense))
    grads.note = f"{t.precision}, release_grads: one matrix's .grad at a time (the largest) + the 1-D params'"
    grads.code = "autograd, each .grad freed in its hook (zfctl/offload/release.py)"
    return True


def _note(items: list[MemoryItem], name: str, note: str) -> None:
    next(i for i in items if i.name == name).note = note


def _accumulate(plan: RunPlan, c: Counts, items: list[MemoryItem], device_kind: str,
                machine: Machine) -> Literal["host", "device"]:
    """Resolve zenflow.accumulate (auto: the device when the sum fits) and add its device line."""
    z = plan.zenflow
    nbytes = 4.0 * c.host
    choice = z.accumulate
    if choice == "auto":
        device_total = sum(i.bytes for i in items if i.where == "device")
        fits = device_kind == "cuda" and machine.cuda and device_fits(device_total, nbytes, machine.gpu_mem)
        choice = "device" if fits else "host"
    if choice == "device":
        items.append(MemoryItem("device", "gradient accumulator", nbytes,
                                "zenflow.accumulate=device: fp32 interval sum, 4 B per host-column element",
                                "zfctl/offload/device_acc.py DeviceAccumulator.buf"))
    return "device" if choice == "device" else "host"


def host_limit(machine: Machine) -> float:
    """Host RAM the plan may use: all but ``HOST_RESERVE`` (a quarter of a machine under 60 GB)."""
    return machine.host_ram - min(HOST_RESERVE, 0.25 * machine.host_ram)


def _largest(items: list[MemoryItem], where: set[str]) -> str:
    top = sorted((i for i in items if i.where in where), key=lambda i: -i.bytes)[:3]
    return ", ".join(f"{i.name} {i.bytes / GB:.1f} GB" for i in top)


def _verdict(items: list[MemoryItem], device_kind: str, device_total: float, node_host: float,
             machine: Machine, requested: str, per_node: int) -> list[str]:
    """Why the machine cannot run the plan ([] = it fits), naming the largest lines. ``node_host``:
    the host RAM one node needs (its ``per_node`` ranks' host lines)."""
    reasons = []
    if requested == "cuda" and not machine.cuda:
        reasons.append("train.device is cuda but the machine has no CUDA device")
    if device_kind == "cuda" and machine.cuda and device_total > (1 - DEVICE_MARGIN) * machine.gpu_mem:
        reasons.append(
            f"device memory: needs {device_total / GB:.1f} GB, {machine.gpu_name} has "
            f"{machine.gpu_mem / GB:.1f} GB (largest: {_largest(items, {'device'})})"
        )
    host_need = node_host
    limit = host_limit(machine)
    if machine.host_ram and host_need > limit:
        where = {"host"} if device_kind == "cuda" else {"host", "device"}
        ranks = f" for {per_node} ranks" if per_node > 1 else ""
        reasons.append(
            f"host RAM: needs {host_need / GB:.1f} GB{ranks}, the machine has {machine.host_ram / GB:.1f} GB of which "
            f"{limit / GB:.1f} GB may be used (largest: {_largest(items, where)})"
        )
    return reasons
