"""ZenFlow's own configuration: the one typed source of truth for every `zenflow.*` option.

This module belongs to the library layer (`offload/`), so it knows nothing of YAML or the CLI.
`zfctl.plan` embeds `ZenFlowConfig` as the `zenflow` section of the run plan and turns each
field's `help` metadata into `--help` text, preset comments and error messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, Union

from zfctl.errors import ConfigError
from zfctl.offload.correction import MODES, DeferredLrScale

# typing.Union, not `|`: zfctl.plan.coerce inspects fields with get_origin(tp) is Union.
Interval = Union[int, Literal["auto"]]  # noqa: UP007


def _f(default, help: str, **kw):
    """A dataclass field carrying its user-facing description."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ZenFlowConfig:
    """How the optimizer splits work between the device and the CPU."""

    topk_ratio: float = _f(
        0.1,
        "Fraction of the columns of every 2-D weight updated on the device each step "
        "(top-k by gradient L1 norm). 1.0 = everything on the device, 0.0 = plain CPU offload.",
    )
    select_strategy: Literal["auto", "step", "epoch"] = _f(
        "auto",
        "How select_interval is counted: 'step' = optimizer steps, 'epoch' = epochs, "
        "'auto' = like 'epoch' (an integer select_interval counts epochs; 'auto' = 1 epoch).",
    )
    select_interval: Interval = _f(
        "auto",
        "Re-select the top-k columns every N steps/epochs (see select_strategy), or 'auto' = once "
        "per epoch (every 256 steps when the optimizer is not told the epoch length).",
    )
    update_interval: Interval = _f(
        4,
        "Apply the CPU AdamW to the non-selected columns every N steps, or 'auto' "
        "(adaptive, bounded by auto_min_interval..auto_max_interval).",
    )
    full_warm_up_rounds: int = _f(
        0, "First N steps are full synchronous CPU-offload steps before any selection."
    )
    overlap_step: bool = _f(
        True,
        "Run the CPU update in the background while the device keeps training; its result is "
        "installed at the next boundary (exactly one interval stale). Off: the step waits.",
    )
    install_lag: int = _f(
        0,
        "With overlap_step: install each CPU update this many steps after the boundary that started "
        "it (or at the next boundary, if sooner); the step waits if it has not finished by then. "
        "0 = at the next boundary, one interval later (the paper). Fewer steps: fresher deferred "
        "columns, less time to hide the update.",
    )
    deferred_lr_scale: DeferredLrScale = _f(
        "off",
        "Scale the CPU step's learning rate for the n steps a deferred column waited: 'off' = x1 "
        "(the paper), 'sqrt' = x sqrt(n) (noisy gradients), 'linear' = x n (consistent gradients), "
        "'repeat' = n AdamW steps with the interval-mean gradient (exact moments, bias correction "
        "and weight decay; n x the CPU arithmetic, same memory traffic). Adam's step is ~lr "
        "whatever the gradient's size, so without it deferred columns move up to n times less than "
        "under AdamW. See zfctl/offload/correction.py.",
    )
    vocab_select: Literal["columns", "rows"] = _f(
        "columns",
        "How the vocabulary matrices (input embedding, output head) choose what the device updates: "
        "'columns' = hidden dimensions across the whole vocabulary, like every other weight (the "
        "paper); 'rows' = the top-k tokens by gradient L1 (the tokens in play, e.g. a classifier's "
        "label words, get their update every step). Same memory and traffic either way.",
    )
    stream_grads: bool = _f(
        True,
        "Copy the non-selected gradient columns to the host during the last backward of a step "
        "(gradient hooks; the training loop announces that backward) instead of inside step().",
    )
    accumulate: Literal["auto", "host", "device"] = _f(
        "auto",
        "Where the non-selected columns' gradients are summed over an interval: 'host' (fp32 on "
        "the CPU, the gradient crosses PCIe every step), 'device' (fp32 on the GPU, 4 B per matrix "
        "element of device memory; only the sum crosses PCIe, once per interval), or 'auto' "
        "(device when the memory estimate says it fits).",
    )
    pin_memory: bool = _f(
        True, "Use page-locked host buffers for the transfer rings (faster, async PCIe copies)."
    )
    auto_ratio: float = _f(
        0.99,
        "update_interval=auto: fraction of 2-D weights whose deferred gradient mass must reach "
        "their per-step selected mass before a CPU update fires.",
    )
    auto_min_interval: int = _f(1, "update_interval=auto: fewest steps between CPU updates.")
    auto_max_interval: int = _f(16, "update_interval=auto: most steps between CPU updates.")
    cpu_threads: int = _f(
        0, "Threads for the native CPU AdamW; 0 = all cores this process may use."
    )
    accumulate_threads: int = _f(
        0,
        "Of cpu_threads, how many the gradient accumulation uses while a CPU update runs (the "
        "update takes the rest); 0 = auto, ~10/38 of them by bytes moved per element.",
    )
    ring_slots: int = _f(4, "Pinned slots in each transfer ring (D2H gradients, H2D params).")
    ring_slot_mb: float = _f(
        32.0, "Size of one ring slot in MiB; large tensors move in slot-sized chunks."
    )
    inflight_mb: float = _f(
        0.0,
        "Hook path: MiB of gradient temporaries the device may hold while their D2H copy runs; "
        "0 = from a D2H bandwidth probe at startup (~2 ms of copy, 16-1024 MiB; on CPU 4 rings).",
    )

    def validate(self, prefix: str = "zenflow") -> ZenFlowConfig:
        """Check ranges and combinations; raise ConfigError naming the dotted key."""

        def bad(name: str, fix: str) -> ConfigError:
            return ConfigError(f"{prefix}.{name}", getattr(self, name), fix)

        if isinstance(self.topk_ratio, bool) or not isinstance(self.topk_ratio, (int, float)):
            raise bad("topk_ratio", "must be a number in [0, 1], e.g. 0.1")
        if not 0.0 <= float(self.topk_ratio) <= 1.0:
            raise bad("topk_ratio", "must be in [0, 1], e.g. 0.1")
        if self.accumulate not in ("auto", "host", "device"):
            raise bad("accumulate", "use one of auto, host, device")
        if self.select_strategy not in ("auto", "step", "epoch"):
            raise bad("select_strategy", "use one of auto, step, epoch")
        for name in ("select_interval", "update_interval"):
            v = getattr(self, name)
            if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise bad(name, "must be 'auto' or an integer >= 1")
        if self.select_strategy != "auto" and self.select_interval == "auto":
            raise bad("select_interval", f"give an integer when select_strategy is {self.select_strategy!r}")
        if (
            self.select_strategy == "step"
            and isinstance(self.select_interval, int)
            and isinstance(self.update_interval, int)
            and self.select_interval < self.update_interval
        ):
            raise bad(
                "select_interval",
                f"must be >= update_interval ({self.update_interval}): "
                "re-selection happens on a CPU-update boundary",
            )
        if self.vocab_select not in ("columns", "rows"):
            raise bad("vocab_select", "use one of columns, rows")
        if self.deferred_lr_scale not in MODES:
            raise bad("deferred_lr_scale", f"use one of {', '.join(MODES)}")
        for name in ("full_warm_up_rounds", "cpu_threads", "accumulate_threads", "install_lag"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "must be an integer >= 0")
        for name in ("overlap_step", "pin_memory", "stream_grads"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if isinstance(self.auto_ratio, bool) or not isinstance(self.auto_ratio, (int, float)) or not 0 < self.auto_ratio <= 1:
            raise bad("auto_ratio", "must be in (0, 1], e.g. 0.99")
        for name in ("auto_min_interval", "auto_max_interval", "ring_slots"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be an integer >= 1")
        if self.auto_max_interval < self.auto_min_interval:
            raise bad("auto_max_interval", f"must be >= auto_min_interval ({self.auto_min_interval})")
        if isinstance(self.ring_slot_mb, bool) or not isinstance(self.ring_slot_mb, (int, float)) or self.ring_slot_mb <= 0:
            raise bad("ring_slot_mb", "must be a positive number of MiB, e.g. 32")
        if isinstance(self.inflight_mb, bool) or not isinstance(self.inflight_mb, (int, float)) or self.inflight_mb < 0:
            raise bad("inflight_mb", "must be a number of MiB >= 0 (0 = measured), e.g. 256")
        return self


def field_help(cls: type) -> dict[str, str]:
    """Map each field of a config dataclass to its help text."""
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}
