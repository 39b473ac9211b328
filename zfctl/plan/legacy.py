"""`zenflow.*` keys of earlier zfctl versions, read as today's with one note each.

Before `zenflow.tuning` existed, its keys sat directly under `zenflow` (`zenflow.install_lag`,
`zenflow.ring_slots`, ...), and `zenflow.select_strategy` said how `select_interval` counted.
Checkpoints of those versions hold such a `plan.yaml`, and people keep `--config` files and
`--set` habits; all of them still load:

    zenflow.KEY (a tuning key)            -> zenflow.tuning.KEY
    select_strategy: step,  interval N    -> select_interval: N          (steps)
    select_strategy: epoch, interval N    -> select_interval: 'N epochs' ('epoch' for 1)
    select_strategy: auto,  interval auto -> select_interval: auto       (1 epoch; 256 steps unknown)
    select_strategy: auto,  interval N    -> select_interval: 'N epochs' ('auto' for 1)
    tuning.accumulate_threads             -> dropped (nothing accumulates on the host per step
                                             since the gradient slots; the CPU update takes the threads)
    tuning.stream_grads                   -> dropped (the hook path is always built; a step whose
                                             final backward is not announced lands in step())

A `select_strategy` without a `select_interval` beside it re-reads the interval the layers below
gave (``below``), as the old merged plan did; a lone integer `select_interval` is today's (steps).
Mapping is a pure function of the mapping given, so a checkpoint's plan and the run folder's plan
are mapped alike and a resume sees no change.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from zfctl.errors import ConfigError
from zfctl.offload.config import EPOCHS, TuningConfig, ZenFlowConfig

TUNING_KEYS = tuple(f.name for f in fields(TuningConfig))
STRATEGIES = ("auto", "step", "epoch")
# Tuning keys that no longer exist, and why (their values change nothing today).
RETIRED = {"accumulate_threads": "the host no longer accumulates gradients per step (zfctl/offload/grads/slots.py); "
           "the CPU update takes every cpu_threads thread",
           "stream_grads": "the gradients always leave during the announced last backward (the hook path); "
           "a library loop that does not call prepare_backward(final=True) gets step() copying them "
           "(docs/design.md, the gradient paths)"}


def _count(interval: Any) -> Any:
    """An old-style interval: an integer count or 'auto' (today's spellings read back to counts)."""
    if isinstance(interval, float) and interval.is_integer():
        return int(interval)
    if isinstance(interval, str):
        if interval.strip() == "epoch":
            return 1
        if m := EPOCHS.match(interval.strip()):
            return int(m.group(1))
    return interval


def select_interval(strategy: Any, interval: Any, where: str = "zenflow") -> Any:
    """Today's ``select_interval`` for an old (select_strategy, select_interval) pair; errors name
    the keys under ``where`` (a DeepSpeed config's ``zero_optimization.zenflow``)."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"{where}.select_strategy", strategy,
                          "use one of auto, step, epoch (it is read into zenflow.select_interval)")
    n = _count(interval)
    if not isinstance(n, int) or isinstance(n, bool):
        if strategy == "auto" and n == "auto":
            return "auto"
        if n == "auto":
            raise ConfigError(f"{where}.select_interval", interval,
                              f"give an integer when select_strategy is {strategy!r}")
        return interval  # not a count: zenflow.select_interval's own check words the error
    if strategy == "step" or n < 1:
        return n
    if strategy == "auto" and n == 1:
        return "auto"
    return "epoch" if n == 1 else f"{n} epochs"


def upgrade_zenflow(zf: Any, *, below: Any = None, where: str = "", notes: list[str] | None = None) -> Any:
    """``zf`` (one layer's zenflow mapping) with old keys as today's; a note per old key in
    ``notes``. ``below``: the zenflow mapping of the layers under this one (for a lone
    select_strategy). Anything that is not a mapping is returned for the schema to refuse."""
    tuning_in = zf.get("tuning") if isinstance(zf, dict) else None
    retired = set(RETIRED) & ((set(zf) if isinstance(zf, dict) else set()) |
                              (set(tuning_in) if isinstance(tuning_in, dict) else set()))
    if not isinstance(zf, dict) or not (set(zf) & {*TUNING_KEYS, "select_strategy"} or retired):
        return zf
    out = dict(zf)
    said = f"{where}: " if where else ""

    def note(text: str) -> None:
        if notes is not None:
            notes.append(f"{said}{text}")

    for key in sorted(retired):  # the input mappings stay as they were
        if key in out:
            out.pop(key)
        else:
            out["tuning"] = {k: v for k, v in out["tuning"].items() if k != key}
        note(f"old key zenflow.tuning.{key} dropped: {RETIRED[key]}")

    tuning = out.get("tuning")
    if set(out) & set(TUNING_KEYS) and (tuning is None or isinstance(tuning, dict)):
        tuning = dict(tuning or {})
        for key in TUNING_KEYS:
            if key not in out:
                continue
            value = out.pop(key)
            if key in tuning and tuning[key] != value:
                raise ConfigError(f"zenflow.{key}", value, f"also given as zenflow.tuning.{key}="
                                  f"{tuning[key]!r}; keep only zenflow.tuning.{key}")
            tuning[key] = value
            note(f"old key zenflow.{key} read as zenflow.tuning.{key}")
        out["tuning"] = tuning
    if "select_strategy" in out:
        strategy = out.pop("select_strategy")
        if "select_interval" in out:
            interval = out["select_interval"]
        elif isinstance(below, dict) and "select_interval" in below:
            interval = below["select_interval"]
        else:
            interval = ZenFlowConfig().select_interval
        out["select_interval"] = new = select_interval(strategy, interval)
        note(f"old keys zenflow.select_strategy={strategy}, select_interval={interval} read as "
             f"zenflow.select_interval={new}")
    return out


def upgrade_fragment(data: Any, *, below: Any = None, where: str = "", notes: list[str] | None = None) -> Any:
    """A plan fragment (``{"zenflow": {...}, ...}``) with its zenflow section upgraded."""
    if not isinstance(data, dict) or not isinstance(data.get("zenflow"), dict):
        return data
    below_zf = below.get("zenflow") if isinstance(below, dict) else None
    return {**data, "zenflow": upgrade_zenflow(data["zenflow"], below=below_zf, where=where, notes=notes)}
