"""The model's sizes as the plan's lines need them: parameter counts and shapes, and the layout's counts.

Split from zfctl/plan/memory.py by concern: what a plan's model is (from its config, without
building it; or a transformers config built on the meta device), how ZenFlow's layout divides
its matrices between device and host columns (``layout_counts``, as zfctl/offload/layout.py
``plan_layout`` assigns them) and one FSDP2 rank's share of them (``shard_shapes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from zfctl.offload.sizing import num_selected
from zfctl.plan.schema import RunPlan

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

    cfg = AutoConfig.for_model(**c)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return size_of_model(model)


def size_of_model(model: Any) -> ModelSize:
    """A built model's sizes (its parameters' global shapes: an FSDP2 DTensor's are the whole
    weight's), for a plan that could not know them before the model was loaded (a hub model
    named by id alone: zfctl/train/optim.py ``settle_for_model``)."""
    from zfctl.offload.layout import vocab_matrices

    cfg = getattr(model, "config", None)
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
