"""`zfctl bench`'s flag checks and the configurations they build: every mistake is one line naming
the flag (exit 2) before anything runs. Split from zfctl/cli/bench.py, which declares the flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from zfctl.errors import ConfigError, UserError

if TYPE_CHECKING:
    from zfctl.bench.grid import BenchConfig
    from zfctl.offload.config import ZenFlowConfig


def _check_out(flag: str, path: Path | None, force: bool, suffix: str | None = None) -> None:
    """Refuse a report path that cannot be written, before the benchmark spends any time."""
    if path is None:
        return
    if suffix and path.suffix.lower() != suffix:
        raise UserError(f"{flag} {path}: the file name must end in {suffix}")
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory: give a file name")
    if not path.parent.exists():
        raise UserError(f"{flag} {path}: folder {path.parent} does not exist; create it first")
    if path.exists() and not force:
        raise UserError(f"{flag} {path} already exists: pass --force to overwrite it, or pick another name")
    from zfctl.writable import check_writable

    check_writable(path.parent, flag, shown=path)  # a read-only folder: refuse now, not after the whole grid


def _at_least(flag: str, v: int | None, minimum: int = 1) -> None:
    if v is not None and v < minimum:
        raise UserError(f"{flag} {v}: must be >= {minimum}")


def _model_config(name: str):
    """The typed ModelConfig of a model preset (cli -> plan is the allowed direction)."""
    from zfctl.plan import plan_from_dict
    from zfctl.plan.resolve import model_fragment

    try:
        return plan_from_dict({"model": model_fragment(name)["model"]}).model
    except ConfigError as e:
        raise UserError(f"--model {name!r}: {e.fix}") from None


# zenflow.* keys the grid and the run flags set on every configuration: --set must not (it would
# be silently overwritten), so it names the flag instead.
_FLAG_KEYS = {
    "topk_ratio": "--topk", "update_interval": "--interval", "overlap_step": "--overlap",
    "tuning.pin_memory": "--pin", "cpu_threads": "--cpu-threads", "accumulate": "--accumulate",
    "full_warm_up_rounds": "--warmup (the bench times after its own untimed steps; no warm-up rounds)",
}


# Without --zenflow the bench runs the reference benchmark's algorithm (the paper, as DeepSpeed runs
# it), as it always has: its rows stay comparable with the reference and with earlier reports.
BENCH_PRESET = "paper"


def _dotted(tree: dict, prefix: str = "") -> list[str]:
    """The dotted keys of the leaves of ``tree`` (``{"tuning": {"pin_memory": 0}}`` -> ``tuning.pin_memory``)."""
    out: list[str] = []
    for k, v in tree.items():
        out += _dotted(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


def _zenflow_config(name: str | None, overrides: list[str], notes: list[str] | None = None):
    """The typed ZenFlowConfig every configuration starts from: a zenflow preset's keys (default
    ``BENCH_PRESET``) with ``--set zenflow.KEY=VALUE`` layered on top. Keys of an older zfctl are
    mapped (zfctl/plan/legacy.py), a line each in ``notes``."""
    from zfctl.offload.config import ZenFlowConfig
    from zfctl.plan.coerce import section_from_dict
    from zfctl.plan.legacy import upgrade_zenflow
    from zfctl.plan.overrides import deep_merge, parse_override
    from zfctl.plan.presets import find_preset, list_presets

    preset = find_preset("zenflow", name or BENCH_PRESET)
    if preset is None:
        names = ", ".join(p.name for p in list_presets("zenflow"))
        raise UserError(f"--zenflow {name!r}: not a zenflow preset; use one of {names}")
    keys: dict = preset.load()["zenflow"] or {}
    sets: dict = {}
    for text in overrides:
        fragment = parse_override(text)  # a malformed --set is a ConfigError naming it
        section, inner = next(iter(fragment.items()))
        if section != "zenflow" or not isinstance(inner, dict):
            raise UserError(f"--set {text}: zfctl bench takes zenflow.* keys only (the model, batch and "
                            "the rest come from its own flags)")
        named = upgrade_zenflow(inner, below=keys)  # an old key names the flag under its new name
        for key in _dotted(named):  # every key: a mapping value (zenflow.tuning={...}) sets several
            if key in _FLAG_KEYS:
                raise UserError(f"--set {text}: zfctl bench sets zenflow.{key} itself; use {_FLAG_KEYS[key]}")
        sets = deep_merge(sets, inner)
    # The --set keys as one layer: an old select_strategy + select_interval pair maps as a pair.
    keys = deep_merge(keys, upgrade_zenflow(sets, below=keys, where="--set", notes=notes))
    return section_from_dict(ZenFlowConfig, keys, "zenflow").validate()


def _recomputes(text: str) -> list[bool]:
    """`--activation-checkpointing on,off` -> [True, False]."""
    from zfctl.bench.grid import OFF, ON

    out = []
    for s in (t.strip().lower() for t in text.split(",")):
        if s not in ON + OFF:
            raise UserError(f"--activation-checkpointing {text!r}: use on, off or on,off")
        out.append(s in ON)
    return list(dict.fromkeys(out))


def _check_grid(points: list[BenchConfig], base: ZenFlowConfig) -> None:
    """Every configuration of the grid valid before the first one runs: a --topk or --interval
    that the base preset's keys refuse (an interval above its select_interval) fails here."""
    for point in points:
        try:
            point.zenflow_config(base)
        except ConfigError as e:
            raise UserError(f"the grid point '{point.label}': {e}") from None
