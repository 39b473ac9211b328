"""ZenFlow's own configuration: the one typed source of truth for every `zenflow.*` option.

This module belongs to the library layer (`offload/`), so it knows nothing of YAML or the CLI.
`zfctl.plan` embeds `ZenFlowConfig` as the `zenflow` section of the run plan and turns each
field's `help` metadata into `--help` text, preset comments and error messages.

The defaults are the `default` preset (presets/zenflow/default.yaml sets nothing): a library user
and `zfctl finetune` get the same optimizer. About nine options say what the algorithm does; the
knobs of the machinery (transfer rings, slot sets, the auto interval's bounds, ...) sit in
`tuning` (`zenflow.tuning.*` in YAML and `--set`).

What a field accepts is in its type hint (integer, number, true/false, the choices of a
`Literal`, `auto`) and its metadata (`ge`, `gt`, `le` bounds, an `example`); `check_fields` reads
both and words the error the same way for everyone: `ZenFlowConfig.validate()` in the library,
and the plan (zfctl/plan/coerce.py words its type errors for these fields with `expectation`).
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from zfctl.errors import ConfigError, UserError
from zfctl.offload.cpu.correction import DeferredLrScale

# typing.Union, not `|`: zfctl.plan.coerce inspects fields with get_origin(tp) is Union.
Interval = Union[int, Literal["auto"]]  # noqa: UP007
AutoBool = Union[bool, Literal["auto"]]  # noqa: UP007
# An integer (steps), or 'auto', 'epoch', 'N epochs': strings the validator checks (EPOCHS).
SelectInterval = Union[int, str]  # noqa: UP007
EPOCHS = re.compile(r"^(\d+)\s*epochs?$")
AUTO_SELECT_STEPS = 256  # select_interval=auto without the epoch length: as DeepSpeed's default
# The longest interval: one gradient slot per step, and the CPU update reads at most this many
# slots in one pass (native/kernels.h ZF_MAX_SLOTS, zfctl/_native.py MAX_SLOTS).
MAX_INTERVAL = 64


def _f(default: Any, help: str, **rule: Any) -> Any:
    """A dataclass field carrying its user-facing description and, for the checked configs, what
    it accepts besides its type: ``ge``/``gt``/``le`` bounds, ``words`` (strings allowed next to a
    number), ``unit`` and ``example`` (for the message)."""
    return field(default=default, metadata={"help": help, **rule})


@dataclass
class TuningConfig:
    """Knobs of the machinery (`zenflow.tuning.*`): none changes the arithmetic except
    `install_lag` (when a CPU update lands) and the auto interval's bounds."""

    CHECKED: ClassVar[bool] = True  # check_fields words every error about these fields

    install_lag: int = _f(
        0,
        "Opt-in: with overlap_step, install each CPU update this many steps after the boundary that "
        "started it (or at the next boundary, if sooner); the step waits if it has not finished by "
        "then. 0 = at the next boundary, one interval later (the paper). 1-2 measured closer to AdamW "
        "but need the CPU update to finish within 1-2 steps (docs/design.md, Defaults).",
        ge=0,
    )
    host_accumulators: Interval = _f(
        "auto",
        "Sets of per-step gradient slots on the host paths with overlap_step (one slot per step of "
        "an interval, model dtype): 2 = the next interval lands in the second while the CPU update "
        "reads the first (update_interval x 2 B per host element more in bf16); 1 = one set, and "
        "the next interval's writes wait for the update to have read each chunk (a step waits when "
        "the update takes longer than about one step); auto = 2 when the plan's host total with it "
        "fits the machine, else 1, decided when the plan is made (plan.yaml holds 1 or 2). "
        "Same results either way.",
        ge=1, le=2,
    )
    grad_layout: Literal["auto", "slots", "carry"] = _f(
        "auto",
        "Host paths: how an interval's host-owned gradient waits for its CPU update. slots = one "
        "page-locked slot per step of the interval in the model dtype (2 B x update_interval per "
        "host element in bf16, x2 with two sets), summed inside the CPU AdamW: the fastest; carry = "
        "one fp32 sum per host element (4 B), each landed chunk added into it as it arrives, behind "
        "a small landing ring: the least host memory. auto = slots when the plan's host total with "
        "them fits the machine, else carry, decided when the plan is made (plan.yaml holds the "
        "answer). Same results either way (docs/design.md, Algorithm).",
    )
    upload_buffer: AutoBool = _f(
        "auto",
        "bf16/fp16 models: the CPU AdamW also writes the updated host columns in the model dtype, "
        "and an install moves those: half the PCIe bytes of the fp32 master, for 2 B per host "
        "element of host memory (page-locked on CUDA, where the master then is not). false = the "
        "install moves the fp32 master and the GPU rounds it (the same bits). auto = on when the "
        "plan's host total with it fits the machine. fp32 models have none.",
    )
    release_grads: bool = _f(
        True,
        "Hook path: free each gradient inside its hook on the last backward (its selected columns "
        "to the device state, its host columns into the step's gradient slot), so the device never "
        "holds every .grad at once. Changes no result (docs/design.md, Algorithm).",
    )
    pin_memory: bool = _f(
        True, "Page-lock the host buffers PCIe copies read or write (the install's source: the "
        "upload buffer or the fp32 master; the gradient slots, the device path's sum, selection "
        "staging): async DMAs instead of staged copies."
    )
    auto_ratio: float = _f(
        0.99,
        "update_interval=auto: fraction of 2-D weights whose deferred gradient mass must reach "
        "their per-step selected mass before a CPU update fires.",
        gt=0, le=1, example=0.99,
    )
    auto_min_interval: int = _f(1, "update_interval=auto: fewest steps between CPU updates.", ge=1)
    auto_max_interval: int = _f(
        16, "update_interval=auto: most steps between CPU updates (each holds a gradient slot on the host "
        "paths: the plan counts this many per set).", ge=1, le=MAX_INTERVAL)
    reserved_cores: Interval = _f(
        "auto",
        "Physical cores of this rank's share kept for the training thread (the thread that launches "
        "device work, the backward's thread, data loading): the native pools never run there. "
        "auto = with a GPU 2 from 8 cores up, 1 with 3-7, none with 1-2; none on the CPU "
        "(docs/design.md, 'Threads and buffer ownership').",
        ge=0,
    )
    pin_threads: Literal["auto", "on", "off"] = _f(
        "auto",
        "Pin each native pool thread to a CPU of its own (the CPUs this process may use, split by "
        "local rank, on the GPU's NUMA node). auto = on with a GPU; off on the CPU, where torch's "
        "compute shares every core and a pinned thread cannot dodge a busy one.",
    )
    ring_slots: int = _f(4, "Device slots of the install ring (H2D params); with ring_slot_mb it sizes the column chunks "
                         "gradients and installs move in.", ge=1)
    ring_slot_mb: float = _f(
        32.0, "Size of one ring slot in MiB; large tensors move in slot-sized chunks.",
        gt=0, unit="MiB", example=32,
    )
    staging_mb: Union[float, Literal["auto"]] = _f(  # noqa: UP007 (coerce.py reads typing.Union)
        "auto",
        "Selections: MiB of page-locked host memory that hold the leaving columns' state until the "
        "CPU worker writes it back (the out buffer); the rows of a selection beyond it are written "
        "on the training thread first (a wait, no other result). At least one 64 MiB piece, at most "
        "2048. auto = what the host has to spare after the plan's other lines (zfctl/plan/layouts.py), "
        "decided when the plan is made (plan.yaml holds the number; 2048 without a plan).",
        gt=0, le=2048, unit="MiB", example=512,
    )
    inflight_mb: float = _f(
        0.0,
        "Hook path: MiB of gradient temporaries the device may hold while their D2H copy runs; "
        "0 = from a D2H bandwidth probe at startup (~2 ms of copy, 16-1024 MiB; on CPU 4 rings).",
        ge=0, unit="MiB", example=256,
    )


@dataclass
class ZenFlowConfig:
    """How the optimizer splits work between the device and the CPU; the defaults are the
    `default` preset."""

    CHECKED: ClassVar[bool] = True

    topk_ratio: float = _f(
        0.1,
        "Fraction of the columns of every 2-D weight updated on the device each step "
        "(top-k by gradient L1 norm). 1.0 = everything on the device, 0.0 = plain CPU offload.",
        ge=0, le=1, example=0.1,
    )
    select_interval: SelectInterval = _f(
        8,
        "Re-select the top-k columns every N optimizer steps (an integer; the important columns "
        "drift, each re-selection costs a column migration and a wait for part of the CPU update), or by epochs: "
        "'epoch' = once per epoch, 'N epochs' = every N (the optimizer needs steps_per_epoch; "
        "zfctl's training loop passes it), 'auto' = once per epoch, every 256 steps when the epoch "
        "length is unknown (DeepSpeed's select_interval: auto; the paper).",
        ge=1, words=("auto", "epoch"), epochs=True,
    )
    update_interval: Interval = _f(
        4,
        "Apply the CPU AdamW to the non-selected columns every N steps (at most 64), or 'auto' "
        "(adaptive, bounded by tuning.auto_min_interval..tuning.auto_max_interval).",
        ge=1, le=MAX_INTERVAL,
    )
    full_warm_up_rounds: int = _f(
        20,
        "First N steps are synchronous full CPU-offload steps before any selection (the CPU AdamW updates every "
        "weight matrix and the step waits: the whole model crosses PCIe both ways each step): "
        "the fast first steps of a fine-tune. 0 = none (the paper).",
        ge=0,
    )
    overlap_step: bool = _f(
        True,
        "Run the CPU update in the background while the device keeps training; its result is "
        "installed at the next boundary (exactly one interval stale). Off: the step waits.",
    )
    deferred_lr_scale: DeferredLrScale = _f(
        "repeat",
        "Scale the CPU step's learning rate for the n steps a deferred column waited: 'off' = x1 "
        "(the paper), 'sqrt' = x sqrt(n) (noisy gradients), 'linear' = x n (consistent gradients), "
        "'repeat' = n AdamW steps with the interval-mean gradient (exact moments, bias correction "
        "and weight decay; n x the CPU arithmetic, same memory traffic). Adam's step is ~lr "
        "whatever the gradient's size, so without it deferred columns move up to n times less than "
        "under AdamW. See zfctl/offload/cpu/correction.py.",
    )
    vocab_select: Literal["columns", "rows"] = _f(
        "rows",
        "How the vocabulary matrices (input embedding, output head) choose what the device updates: "
        "'columns' = hidden dimensions across the whole vocabulary, like every other weight (the "
        "paper); 'rows' = the top-k tokens by gradient L1 (the tokens in play, e.g. a classifier's "
        "label words, get their update every step). Same memory and traffic either way.",
    )
    accumulate: Literal["auto", "host", "device"] = _f(
        "auto",
        "Where the non-selected columns' gradients are summed over an interval: 'host' (fp32 on "
        "the CPU, the gradient crosses PCIe every step), 'device' (fp32 on the GPU, 4 B per matrix "
        "element of device memory; only the sum crosses PCIe, once per interval), or 'auto' "
        "(device when the memory estimate says it fits the plan's machine; decided when the plan is "
        "made, plan.yaml holds host or device, and the run builds that).",
    )
    cpu_threads: int = _f(
        0, "Threads for the native CPU AdamW; 0 = all cores this process may use.", ge=0
    )
    tuning: TuningConfig = field(
        default_factory=TuningConfig,
        metadata={"help": "Knobs of the machinery (zenflow.tuning.*): rings, threads, the auto "
                  "interval's bounds, install_lag."},
    )

    def __post_init__(self) -> None:
        # One spelling per epoch count ('1 epochs' -> 'epoch', '2epoch' -> '2 epochs'), so plans
        # that mean the same compare equal.
        if isinstance(self.select_interval, str):
            self.select_interval = _spell_epochs(self.select_interval)

    def validate(self, prefix: str = "zenflow") -> ZenFlowConfig:
        """Check every field against its rule and the few combinations; raise ConfigError naming
        the dotted key."""
        check_fields(self, prefix)
        t = self.tuning
        if t.auto_max_interval < t.auto_min_interval:
            raise ConfigError(f"{prefix}.tuning.auto_max_interval", t.auto_max_interval,
                              f"must be >= tuning.auto_min_interval ({t.auto_min_interval}); raise "
                              "auto_max_interval or lower auto_min_interval")
        sel, upd = self.select_interval, self.update_interval
        if isinstance(sel, int) and isinstance(upd, int) and sel < upd:
            raise ConfigError(f"{prefix}.select_interval", sel,
                              f"must be >= update_interval ({upd}): re-selection happens on a CPU-update "
                              f"boundary; raise {prefix}.select_interval or lower {prefix}.update_interval")
        return self

    def select_epochs(self) -> int | None:
        """Epochs between selections ('auto' and 'epoch' = 1), or None when counted in steps."""
        if isinstance(self.select_interval, int):
            return None
        m = EPOCHS.match(self.select_interval)
        return int(m.group(1)) if m else 1

    def select_period(self, steps_per_epoch: int | None) -> int:
        """Steps between selections: an integer counts steps; epochs need ``steps_per_epoch``
        ('auto' without it: every 256 steps)."""
        epochs = self.select_epochs()
        if epochs is None:
            return int(self.select_interval)
        if steps_per_epoch:
            return epochs * int(steps_per_epoch)
        if self.select_interval == "auto":
            return AUTO_SELECT_STEPS
        raise UserError(f"zenflow.select_interval={self.select_interval} needs the epoch length: pass "
                        "steps_per_epoch to ZenFlowOptimizer, or give select_interval in steps")


def _spell_epochs(text: str) -> str:
    m = EPOCHS.match(text.strip().lower())
    if m is None:
        return text
    n = int(m.group(1))
    return "epoch" if n == 1 else f"{n} epochs"


# -- the one validator --------------------------------------------------------------------------
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _parts(tp: Any, meta: typing.Mapping[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """(the number/bool/str type, the words allowed beside it) of a field's type hint."""
    words = tuple(meta.get("words", ()))
    if get_origin(tp) is Literal:
        return None, get_args(tp)
    if get_origin(tp) is Union:
        base = None
        for arg in get_args(tp):
            if get_origin(arg) is Literal:
                words += get_args(arg)
            elif arg is not str:
                base = arg
        return base, words
    return tp, words


def _num(x: float) -> str:
    return f"{x:g}"


def expectation(tp: Any, meta: typing.Mapping[str, Any]) -> str:
    """What a field accepts, in words: the fix of every error about its value."""
    base, words = _parts(tp, meta)
    if base is None:
        return "use one of " + ", ".join(str(w) for w in words)
    if base is bool:
        return "must be true or false" + "".join(f" or {w}" for w in words)
    what = "an integer" if base is int else "a number"
    if meta.get("unit"):
        what += f" of {meta['unit']}"
    ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
    if le is not None and ge is not None:
        what += f" in [{_num(ge)}, {_num(le)}]"
    elif le is not None and gt is not None:
        what += f" in ({_num(gt)}, {_num(le)}]"
    elif ge is not None:
        what += f" >= {_num(ge)}"
    elif gt is not None:
        what += f" > {_num(gt)}"
    if meta.get("epochs"):
        what += " (steps), " + ", ".join(words) + " or 'N epochs'"
    elif words:
        what += " or " + " or ".join(str(w) for w in words)
    if "example" in meta:
        what += f", e.g. {meta['example']}"
    return f"must be {what}"


def accepts(tp: Any, meta: typing.Mapping[str, Any], value: Any) -> bool:
    """Whether ``value`` is one of the field's words or a number of its type within its bounds."""
    base, words = _parts(tp, meta)
    if isinstance(value, str):
        return value in words or (bool(meta.get("epochs")) and (m := EPOCHS.match(value)) is not None
                                  and int(m.group(1)) >= 1)
    if base is None:
        return any(type(w) is type(value) and w == value for w in words)
    if isinstance(value, bool) or base is bool:
        return base is bool and isinstance(value, bool)
    if not isinstance(value, int if base is int else (int, float)) or not math.isfinite(value):
        return False
    ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
    return ((ge is None or value >= ge) and (gt is None or value > gt) and (le is None or value <= le))


def check_fields(obj: Any, prefix: str) -> None:
    """Check each field of a checked config (and its nested ones) against its type and metadata."""
    hints = _hints(type(obj))
    for f in fields(obj):
        key, value, tp = f"{prefix}.{f.name}", getattr(obj, f.name), hints[f.name]
        if isinstance(tp, type) and is_dataclass(tp):
            if not isinstance(value, tp):
                raise ConfigError(key, value, f"expected a {tp.__name__} (zfctl.offload.config); from a mapping "
                                              f"of {key}.* keys build {tp.__name__}(**mapping)")
            check_fields(value, key)
        elif not accepts(tp, f.metadata, value):
            raise ConfigError(key, value, expectation(tp, f.metadata))


def field_expectation(cls: type, name: str) -> str | None:
    """The wording of a checked config's field rule; None for other dataclasses (zfctl.plan's
    sections check themselves in zfctl/plan/validate.py)."""
    if not getattr(cls, "CHECKED", False):
        return None
    f = next(f for f in fields(cls) if f.name == name)
    tp = _hints(cls)[name]
    return None if isinstance(tp, type) and is_dataclass(tp) else expectation(tp, f.metadata)
