"""``model.config`` (``model.source: config``) checked against the transformers config class it
builds, without torch: the plan and the pre-flight refuse a mistyped key before the plan prints,
not after the data is tokenised and a model load begins (zfctl/train/models/load.py builds it)."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from zfctl.errors import ConfigError


def config_class(spec: dict[str, Any]) -> tuple[Any, str, str | None]:
    """The transformers config class of ``spec``, its ``model_type`` and the architecture named
    (``architecture`` or ``architectures: [..]``; None: the type's causal LM)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lms

    archs = spec.get("architectures") or [None]  # HF's config.json spelling
    arch = spec.get("architecture") or archs[0]
    model_type = spec.get("model_type")
    if model_type is None:
        by_class = {cls: mt for mt, cls in causal_lms.items()}
        model_type = by_class.get(arch, "llama") if arch else "llama"
    if model_type not in causal_lms:
        raise ConfigError("model.config.model_type", model_type,
                          "not a causal LM type transformers knows; e.g. llama, gpt2, opt, mistral, qwen2")
    return type(AutoConfig.for_model(model_type)), model_type, arch


def check_config_keys(spec: dict[str, Any]) -> Any:
    """Refuse a key of ``spec`` that its config class does not have (the nearest valid key, or
    how to drop it); returns the class. ``architecture(s)`` and ``model_type`` choose the class."""
    config_cls, _, _ = config_class(spec)
    valid = set(config_cls().to_dict()) | set(inspect.signature(config_cls.__init__).parameters)
    for key, value in spec.items():
        if key in ("architectures", "architecture", "model_type") or key in valid:
            continue
        near = difflib.get_close_matches(key, sorted(valid), n=1)
        fix = (f"did you mean model.config.{near[0]}?" if near else
               f"transformers' {config_cls.__name__} has no such field; remove --set model.config.{key} (or the "
               "key in your --config file)")
        raise ConfigError(f"model.config.{key}", value, f"unknown key; {fix}")
    return config_cls
