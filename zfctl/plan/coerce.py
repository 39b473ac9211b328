"""Turn loosely typed config values (YAML, JSON, `--set`) into the schema's field types.

The schema's type hints are the contract: a value is accepted when it converts without losing
meaning (YAML's `2e-5` arrives as a *string* because PyYAML follows YAML 1.1, a list becomes the
`betas` tuple, `1000.0` is a fine integer) and rejected otherwise with a `ConfigError` naming the
dotted key and what would be accepted. Unknown keys get the nearest valid key suggested.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin

from zfctl.errors import ConfigError
from zfctl.offload.config import field_expectation

# `Optional[X]` and `X | None` have different origins (typing.Union vs types.UnionType).
_UNIONS = (Union, types.UnionType)

# The largest integer a float holds exactly: `1e30` arrives as a float (or a string, from YAML)
# whose digits are not what was typed, and no integer setting (steps, epochs, sizes) comes near it.
_INT_LIMIT = 2**53

_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


def suggest(name: str, choices: typing.Iterable[str], prefix: str = "") -> str:
    """' (did you mean PREFIX.X?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def describe(tp: Any) -> str:
    """Human wording for a type hint, used in error messages."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(c) for c in get_args(tp))
    if origin in _UNIONS:
        parts = [describe(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(parts)
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        tuple: "a list of numbers",
        list: "a list",
        dict: "a mapping",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def _fail(key: str, value: Any, tp: Any) -> ConfigError:
    fix = f"expected {describe(tp)}"
    if get_origin(tp) is Literal and isinstance(value, str):
        fix += suggest(value, [str(c) for c in get_args(tp)])
    return ConfigError(key, value, fix)


def _number(value: Any) -> float | None:
    """A float for int/float/numeric-string values, None otherwise (bools are not numbers)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def coerce(value: Any, tp: Any, key: str, *, nullable: bool = False) -> Any:
    """Convert `value` to type hint `tp` or raise ConfigError(key, ...)."""
    origin = get_origin(tp)
    if value is None:
        if nullable or (origin in _UNIONS and type(None) in get_args(tp)):
            return None
        raise ConfigError(key, value, f"must not be null; expected {describe(tp)}")
    if origin in _UNIONS:
        # Literal members first so that 'auto' wins over a failed int parse.
        members = sorted(
            (a for a in get_args(tp) if a is not type(None)), key=lambda a: get_origin(a) is not Literal
        )
        for member in members:
            try:
                return coerce(value, member, key)
            except ConfigError:
                continue
        raise _fail(key, value, tp)
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in get_args(tp):
            value = "on" if value else "off"  # YAML 1.1 reads a bare off/on (`--set k=off`) as a bool
        for choice in get_args(tp):
            # `True == 1` in Python; compare types too so `1` never matches a bool literal.
            if type(choice) is type(value) and choice == value:
                return choice
        raise _fail(key, value, tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise _fail(key, value, tp)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value  # exact as written, however large
        num = _number(value)
        if num is None or not math.isfinite(num) or not num.is_integer():
            raise _fail(key, value, tp)
        if abs(num) > _INT_LIMIT:  # `1e30` passes is_integer(), but no count or size means it
            raise ConfigError(key, value, f"expected an integer; written as a number with a fraction or "
                              f"exponent it must be at most {_INT_LIMIT:,} (2**53)")
        return int(num)
    if tp is float:
        num = _number(value)
        if num is None:
            raise _fail(key, value, tp)
        if not math.isfinite(num):  # NaN or inf is never a meaningful setting (lr=inf trains on NaN)
            raise ConfigError(key, value, "expected a finite number")
        return num
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. a YAML `subset: 2024` meant as a name
        raise _fail(key, value, tp)
    if tp is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _fail(key, value, tp)
        out = []
        for i, item in enumerate(value):
            num = _number(item)
            if num is None or not math.isfinite(num):
                raise ConfigError(f"{key}[{i}]", item, "expected a number" if num is None else "expected a finite number")
            out.append(num)
        return tuple(out)
    if tp is list or origin is list:
        if not isinstance(value, (list, tuple)):
            raise _fail(key, value, tp)
        return list(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise _fail(key, value, tp)
        return dict(value)
    raise TypeError(f"zfctl bug: no coercion for {key} of type {tp!r}")


@cache
def field_types(cls: type) -> dict[str, tuple[Any, bool]]:
    """{field name: (resolved type hint, nullable)} of a config dataclass.

    A field whose default is None accepts null even when its hint says `dict`/`list`.
    """
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        default = f.default if f.default is not MISSING else None
        out[f.name] = (hints[f.name], f.default is not MISSING and default is None)
    return out


def field_names(cls: type, prefix: str = "") -> list[str]:
    """Every key of config dataclass `cls`, a nested section's as ``tuning.x`` (one level)."""
    out = []
    for name, (tp, _) in field_types(cls).items():
        out.append(prefix + name)
        if isinstance(tp, type) and is_dataclass(tp) and not prefix:
            out += field_names(tp, f"{name}.")
    return out


def section_from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build config dataclass `cls` from a mapping: unknown keys rejected, values coerced.

    A field typed as a dataclass is a nested section (``zenflow.tuning``), built the same way.
    For the configs that check themselves (zfctl/offload/config.py ``check_fields``) a value of
    the wrong type is refused in their words, so the CLI and the library say the same thing.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, data, f"expected a mapping of {prefix}.* keys")
    types = field_types(cls)
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}"
        if name not in types:
            valid = field_names(cls)
            hint = suggest(str(name), valid, f"{prefix}.")
            fix = f"unknown key{hint}" if hint else f"unknown key; valid {prefix} keys: {', '.join(valid)}"
            raise ConfigError(key, value, fix)
        tp, nullable = types[name]
        if isinstance(tp, type) and is_dataclass(tp):
            kwargs[name] = section_from_dict(tp, value, key)
            continue
        try:
            kwargs[name] = coerce(value, tp, key, nullable=nullable)
        except ConfigError as e:
            words = field_expectation(cls, name)
            if words is None or e.key != key:
                raise
            raise ConfigError(key, value, words) from None
    return cls(**kwargs)
