"""`--set section.key=value` overrides and the deep merge that layers plan fragments.

Values are parsed as YAML, so `--set train.lr=1e-4` is a number, `--set zenflow.overlap_step=false`
a bool, `--set train.betas=[0.9,0.95]` a list and `--set train.max_steps=null` clears a value.
Keys under a mapping-valued field go deeper: `--set model.config.num_hidden_layers=2`.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from zfctl.errors import ConfigError

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def deep_merge(base: dict, update: dict) -> dict:
    """A new dict: `update` layered over `base`; nested mappings merge, everything else replaces."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> dict:
    """'train.lr=1e-4' -> {'train': {'lr': 0.0001}}; malformed input is a ConfigError on --set."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key):
        raise ConfigError("--set", text, "use --set section.key=value, e.g. --set train.lr=1e-4")
    try:
        value: Any = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(
            key, raw, "the value is not valid YAML; quote strings with special characters"
        ) from None
    # PyYAML (YAML 1.1) reads '1e-4' as a string; numbers are coerced against the schema later.
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def apply_overrides(base: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Layer each `--set` over `base`, in order (a later --set of the same key wins)."""
    for text in overrides:
        base = deep_merge(base, parse_override(text))
    return base
