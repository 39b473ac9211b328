"""The configurations a benchmark runs: the user's grid plus the two baselines.

A grid is the cross product of the `--topk`, `--interval`, `--overlap`, `--pin`,
`--activation-checkpointing` and `--grad-layout` lists (the layout applies to ZenFlow points only:
the yardstick keeps the base configuration's). Every grid also runs `zero-offload` (topk 0, update every
step, no overlap: plain ZeRO-Offload, the yardstick of the speedup column), once per pin and
recompute setting so that speedups compare like with like, and `off` (topk 1: everything on the
device, no CPU work) once per recompute setting when its device state fits; unless `--baselines`
leaves them out (several runs of one shape need them only once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, cast

from zfctl.errors import UserError
from zfctl.offload.config import Interval, ZenFlowConfig

ON = ("on", "true", "yes", "1")
OFF = ("off", "false", "no", "0")


@dataclass(frozen=True)
class BenchConfig:
    """One point of the grid; `name` is 'zenflow', 'zero-offload' or 'off'."""

    name: str
    topk: float
    interval: Interval
    overlap: bool
    pin: bool
    recompute: bool = False  # train.activation_checkpointing on the preset model (--activation-checkpointing)
    layout: Literal["slots", "carry"] | None = None  # zenflow.tuning.grad_layout (--grad-layout); None: the base configuration's

    @property
    def label(self) -> str:
        again = ", recompute" if self.recompute else ""
        if self.name == "off":
            return f"off (all on device){again}"
        tag = "zero-offload" if self.name == "zero-offload" else f"topk {self.topk:g}, U {self.interval}"
        layout = f", {self.layout}" if self.layout else ""
        return f"{tag}{layout}, overlap {'on' if self.overlap else 'off'}, pin {'on' if self.pin else 'off'}{again}"

    def zenflow_config(self, base: ZenFlowConfig) -> ZenFlowConfig:
        """`base` with this point's four knobs; no warm-up rounds (the bench has its own). The
        zero-offload yardstick always accumulates on the host, as ZeRO-Offload does."""
        return replace(
            base,
            accumulate=base.accumulate if self.name == "zenflow" else "host",
            topk_ratio=self.topk,
            update_interval=self.interval,
            overlap_step=self.overlap,
            tuning=replace(base.tuning, pin_memory=self.pin, grad_layout=self.layout or base.tuning.grad_layout),
            full_warm_up_rounds=0,
        ).validate()


def _items(flag: str, text: str) -> list[str]:
    items = [s.strip() for s in str(text).split(",")]
    if not items or any(not s for s in items):
        raise UserError(
            f"{flag} {text!r}: give a comma-separated list without empty items, e.g. {flag} 0.1,0.2"
        )
    return items


def parse_topks(text: str) -> list[float]:
    """'0.1,0.2' -> [0.1, 0.2]; each in [0, 1]."""
    out = []
    for s in _items("--topk", text):
        try:
            v = float(s)
        except ValueError:
            raise UserError(
                f"--topk {s!r} is not a number: give ratios in [0, 1], e.g. --topk 0.1,0.2"
            ) from None
        if not 0.0 <= v <= 1.0 or math.isnan(v):
            raise UserError(f"--topk {s}: ratios must be in [0, 1], e.g. --topk 0.1,0.2")
        out.append(v)
    return list(dict.fromkeys(out))


def parse_intervals(text: str) -> list[Interval]:
    """'2,4,auto' -> [2, 4, 'auto']; integers >= 1 or 'auto'."""
    out: list[Interval] = []
    for s in _items("--interval", text):
        if s.lower() == "auto":
            out.append("auto")
            continue
        try:
            v = int(s)
        except ValueError:
            raise UserError(f"--interval {s!r}: give integers >= 1 or 'auto', e.g. --interval 2,4") from None
        if v < 1:
            raise UserError(f"--interval {s}: update intervals must be >= 1, e.g. --interval 2,4")
        out.append(v)
    return list(dict.fromkeys(out))


def parse_switch(flag: str, text: str | None, negated: bool) -> list[bool]:
    """`--overlap on,off` -> [True, False]; `--no-overlap` (negated) -> [False]."""
    if negated:
        if text is not None:
            raise UserError(f"--{flag} {text!r} and --no-{flag} contradict each other: give one of them")
        return [False]
    if text is None:
        return [True]
    out = []
    for s in _items(f"--{flag}", text):
        if s.lower() in ON:
            out.append(True)
        elif s.lower() in OFF:
            out.append(False)
        else:
            raise UserError(f"--{flag} {s!r}: use on, off or on,off (or --no-{flag})")
    return list(dict.fromkeys(out))


def reference_interval(intervals: list[Interval]) -> int:
    """The interval that sets how many steps every configuration measures (the longest given)."""
    ints = [i for i in intervals if isinstance(i, int)]
    default = ZenFlowConfig().update_interval
    return max(ints) if ints else (default if isinstance(default, int) else 4)


def measured_steps(interval: Interval, iterations: int, ref_interval: int) -> int:
    """Steps timed for one configuration: at least `iterations` x the reference interval, in
    whole intervals of its own. So every configuration is timed over (about) the same number of
    steps and contains the same mix of accumulation and update steps as a long run."""
    want = iterations * ref_interval
    if not isinstance(interval, int):
        return want
    return math.ceil(want / interval) * interval


def warmup_steps(interval: Interval, warmup: int) -> int:
    """Untimed steps, rounded up to whole intervals so the timed window starts at an interval."""
    if not isinstance(interval, int) or warmup == 0:
        return warmup
    return math.ceil(warmup / interval) * interval


def parse_layouts(text: str | None) -> list[Literal["slots", "carry"] | None]:
    """`--grad-layout slots,carry` -> ['slots', 'carry']; None (not given) -> [None]: the base
    configuration's layout, unlabelled."""
    if text is None:
        return [None]
    out: list[Literal["slots", "carry"] | None] = []
    for s in _items("--grad-layout", text):
        if s not in ("slots", "carry"):
            raise UserError(f"--grad-layout {s!r}: use slots, carry or slots,carry")
        out.append(cast(Literal["slots", "carry"], s))
    return list(dict.fromkeys(out))


BASELINES = ("off", "zero-offload")


def parse_baselines(text: str) -> tuple[str, ...]:
    """`--baselines off,zero-offload` (the default), `off`, `zero-offload` or `none`."""
    items = _items("--baselines", text)
    if items == ["none"]:
        return ()
    for s in items:
        if s not in BASELINES:
            raise UserError(f"--baselines {s!r}: use off, zero-offload, off,zero-offload or none")
    return tuple(b for b in BASELINES if b in items)


def build_grid(
    topks: list[float], intervals: list[Interval], overlaps: list[bool], pins: list[bool], *, with_off: bool,
    with_zero_offload: bool = True, recomputes: list[bool] | None = None,
    layouts: list[Literal["slots", "carry"] | None] | None = None,
) -> list[BenchConfig]:
    """Per recompute setting: baselines first (zero-offload per pin setting, then off), then the
    grid; no duplicates."""
    configs = []
    for again in recomputes or [False]:
        if with_zero_offload:
            configs += [BenchConfig("zero-offload", 0.0, 1, False, pin, again) for pin in pins]
        if with_off:
            configs.append(BenchConfig("off", 1.0, 1, False, pins[0], again))
        for topk in topks:
            for interval in intervals:
                for overlap in overlaps:
                    for pin in pins:
                        if topk == 0.0 and interval == 1 and not overlap and with_zero_offload:
                            continue  # identical to the zero-offload baseline already in the list
                        if topk == 1.0 and with_off:
                            continue  # nothing is offloaded: the same as the 'off' baseline
                        configs += [BenchConfig("zenflow", topk, interval, overlap, pin, again, layout)
                                    for layout in layouts or [None]]
    return configs
