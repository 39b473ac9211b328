"""What to change when a plan does not fit its machine, and ``--fit``, which changes it.

The changes are tried cheapest first, by what they cost the run (``STEPS``):

1. the host gradient layout (zfctl/plan/layouts.py ``ORDER``): two slot sets -> one -> the fp32
   carry -> the sum on the device, each with its host bytes per element per interval (speed
   only; the arithmetic is the same). Under ``auto`` the estimate has already taken the first
   that fits, so this step moves only a layout the plan fixed;
2. ``train.activation_checkpointing=true``: about one more forward pass per step, no accuracy;
3. ``zenflow.accumulate``, the other side: the interval's sum moves between device and host
   (speed only; the arithmetic is the same);
4. a smaller ``train.micro_batch_size`` with more ``train.gradient_accumulation_steps``: the same
   global batch, so the same optimizer steps; slower per token;
5. ``zenflow.topk_ratio`` down the ladder to ``MIN_TOPK`` (0.05): fewer columns updated every
   step, which costs accuracy (docs/accuracy.md: a larger ratio narrows the gap to AdamW, a
   smaller one widens it); never lower, and the advice says so when even that is not enough;
6. ``data.max_length`` halved down to ``MIN_LENGTH``: it changes what the model learns from, so
   it comes last.

They accumulate, greedily: the cheapest step that brings the plan closer to fitting (the sum of
what the device and the host lack) is taken, with its first value that fits or else the one that
comes closest, and the search starts over from the cheapest step, until the plan fits or no step
helps. A step that brings nothing (activation checkpointing when only the host is short) is left
out until another change makes it useful (the device accumulator fills the device). Then each
kept change is dropped again if the plan fits without it, so the list is what this plan needs. Every estimate is :func:`zfctl.plan.memory.estimate`,
line by line, so a line another part of the code changes flows into the search as it is.

``train.activation_checkpointing: auto`` resolves here too (:func:`resolve_activation_checkpointing`):
on when the plan does not fit without it and comes closer with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zfctl.errors import ConfigError, UserError
from zfctl.plan.io import plan_from_dict, plan_to_dict
from zfctl.plan.layouts import ORDER, Layout, bytes_per_element
from zfctl.plan.machine import GB, Machine, target_machine
from zfctl.plan.memory import MemoryEstimate, estimate
from zfctl.plan.schema import RunPlan
from zfctl.plan.verdict import shortfall as machine_shortfall

MIN_TOPK = 0.05  # --fit never goes below it: fewer device columns cost accuracy (docs/accuracy.md)
TOPK_LADDER = (0.5, 0.3, 0.2, 0.15, 0.1, 0.075, MIN_TOPK)
MIN_LENGTH = 128  # shorter sequences cut most instructions and answers short; --fit stops here


@dataclass
class Change:
    """One step of the advice: the keys it sets, as ``--set`` flags, and what it costs."""

    sets: dict[str, Any]
    cost: str

    @property
    def flags(self) -> str:
        return " ".join(f"--set {k}={_yaml(v)}" for k, v in self.sets.items())


@dataclass
class FitResult:
    """The plan with ``changes`` applied and its estimate; ``fits`` False: nothing in reach fits."""

    fits: bool
    changes: list[Change]
    plan: RunPlan
    estimate: MemoryEstimate
    before: MemoryEstimate  # the plan as given
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"fits": self.fits, "changes": [{"set": c.sets, "flags": c.flags, "cost": c.cost}
                                               for c in self.changes],
                "flags": " ".join(c.flags for c in self.changes), "notes": self.notes}


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def shortfall(est: MemoryEstimate) -> float:
    """Bytes the machine lacks for ``est``: the device's over its usable share, plus the host's
    (one node's, as the verdict counts it: verdict.py ``shortfall``)."""
    return machine_shortfall(est.device_total, est.node_host_total, est.device_kind, est.machine)


def with_sets(plan: RunPlan, sets: dict[str, Any]) -> RunPlan:
    """``plan`` with dotted keys set, validated like any plan (ConfigError when it refuses)."""
    data = plan_to_dict(plan)
    for key, value in sets.items():
        *path, name = key.split(".")
        node = data
        for part in path:  # a section, or a nested one (zenflow.tuning)
            node = node[part]
        node[name] = value
    return plan_from_dict(data)


# -- the steps, cheapest first: each yields the changes to try, weakest first ---------------------


def _layouts(plan: RunPlan, est: MemoryEstimate) -> list[Change]:
    """The layouts after the estimate's own, leaner first, each as the keys that select it."""
    if est.item("fp32 master") == 0:  # no host columns: no layout
        return []
    now = Layout(est.accumulate, est.grad_layout, est.host_accumulators if est.grad_layout == "slots" else 1)
    was = bytes_per_element(plan, now)
    order = list(ORDER)
    later = order[order.index(now) + 1:] if now in order else order
    out = []
    for lay in later:
        if lay.accumulate == "device" and est.device_kind != "cuda":
            continue
        if lay.accumulate == "device":
            sets: dict[str, Any] = {"zenflow.accumulate": "device"}
        else:
            sets = {"zenflow.accumulate": "host"} if plan.zenflow.accumulate == "device" else {}
            sets["zenflow.tuning.grad_layout"] = lay.grad_layout
            if lay.grad_layout == "slots":
                sets["zenflow.tuning.host_accumulators"] = lay.sets
        where = " on the host" + (" + 4 B on the device" if lay.accumulate == "device" else "")
        out.append(Change(sets, f"gradient layout {lay.words()}: {bytes_per_element(plan, lay)} B per host element "
                                f"per interval{where} (was {was} B): speed only"))
    return out


def _checkpointing(plan: RunPlan, est: MemoryEstimate) -> list[Change]:
    if plan.train.activation_checkpointing is True:
        return []
    return [Change({"train.activation_checkpointing": True}, "recompute per layer: about one more forward per step")]


def _accumulate(plan: RunPlan, est: MemoryEstimate) -> list[Change]:
    if est.device_kind != "cuda" or est.item("fp32 master") == 0:  # no host columns: nothing is summed
        return []
    other = "host" if est.accumulate == "device" else "device"
    return [Change({"zenflow.accumulate": other}, f"the interval's gradient sum on the {other}: speed only")]


def _micro_batch(plan: RunPlan, est: MemoryEstimate) -> list[Change]:
    mbs, gas = plan.train.micro_batch_size, plan.train.gradient_accumulation_steps
    smaller = [d for d in range(mbs - 1, 0, -1) if mbs % d == 0]
    return [Change({"train.micro_batch_size": d, "train.gradient_accumulation_steps": gas * mbs // d},
                   f"same global batch ({mbs * gas} sequences) in more, smaller micro-batches: slower per token")
            for d in smaller]


def _topk(plan: RunPlan, est: MemoryEstimate) -> list[Change]:
    r = float(plan.zenflow.topk_ratio)
    return [Change({"zenflow.topk_ratio": k}, f"fewer columns updated every step ({r:g} -> {k:g}): costs accuracy")
            for k in TOPK_LADDER if k < r]


def _max_length(plan: RunPlan, est: MemoryEstimate) -> list[Change]:
    n, out = plan.data.max_length, []
    while n // 2 >= MIN_LENGTH:
        n //= 2
        out.append(Change({"data.max_length": n}, f"sequences cut at {n} tokens: the model sees less of each record"))
    return out


STEPS = (_layouts, _checkpointing, _accumulate, _micro_batch, _topk, _max_length)


def fit(plan: RunPlan, machine: Machine | None = None) -> FitResult:
    """The cheapest changes that make ``plan`` fit ``machine`` (default: the plan's target)."""
    machine = machine or target_machine(plan.machine)
    est = estimate(plan, machine)
    if est.fits or est.size is None or est.no_model_fits:  # the process alone too much: nothing to try
        return FitResult(est.fits, [], plan, est, est)
    kept, current, cur_est = _greedy(plan, est, machine)
    notes = []
    if not cur_est.fits and float(current.zenflow.topk_ratio) > 0:
        notes.append(f"zenflow.topk_ratio is not lowered below {MIN_TOPK:g}: that costs too much accuracy")
    if cur_est.fits:
        kept, current, cur_est = _prune(plan, kept, machine, current, cur_est)
    return FitResult(cur_est.fits, kept, current, cur_est, est, notes)


def _greedy(plan: RunPlan, est: MemoryEstimate, machine: Machine) -> tuple[list[Change], RunPlan, MemoryEstimate]:
    """Cheapest first: take the first step that brings the plan closer to fitting, then start over
    from the cheapest (a step may have moved the shortage to the other side, where a cheaper one
    now helps). The shortfall falls strictly each round, so this ends."""
    current, cur_est, kept = plan, est, []
    while not cur_est.fits:
        for step in STEPS:
            found = _best(step, current, cur_est, machine)
            if found is not None:
                change, current, cur_est = found
                kept.append(change)
                break
        else:
            break  # no step helps any more
    return kept, current, cur_est


def _best(step, plan: RunPlan, est: MemoryEstimate,
          machine: Machine) -> tuple[Change, RunPlan, MemoryEstimate] | None:
    """The step's first value that fits, else the one that comes closest; None when none helps."""
    best: tuple[Change, RunPlan, MemoryEstimate] | None = None
    for change in step(plan, est):
        try:
            candidate = with_sets(plan, change.sets)
        except ConfigError:  # a value this plan's other keys refuse: not a way out
            continue
        e = estimate(candidate, machine)
        if shortfall(e) < shortfall(best[2] if best else est):
            best = (change, candidate, e)
            if e.fits:
                break
    return best


def _prune(plan: RunPlan, kept: list[Change], machine: Machine, current: RunPlan,
           cur_est: MemoryEstimate) -> tuple[list[Change], RunPlan, MemoryEstimate]:
    """Drop each change the plan fits without (the later, stronger ones may have made it redundant)."""
    i = 0
    while i < len(kept) - 1:
        rest = kept[:i] + kept[i + 1:]
        candidate = with_sets(plan, {k: v for c in rest for k, v in c.sets.items()})
        e = estimate(candidate, machine)
        if e.fits:
            kept, current, cur_est = rest, candidate, e
        else:
            i += 1
    return kept, current, cur_est


def fit_or_fail(plan: RunPlan) -> FitResult:
    """``--fit``: the plan that fits, or a UserError (one line, exit 2) saying that nothing does."""
    result = fit(plan)
    if result.fits:
        return result
    est = result.estimate
    if est.no_model_fits:
        raise UserError(f"--fit: {est.no_model_fits}")
    if est.size is None:
        raise UserError("--fit: the model's size is unknown (set model.params_b), so nothing can be fitted")
    tried = " ".join(c.flags for c in result.changes) or "no change helps"
    raise UserError(f"--fit: nothing makes this plan fit: with {tried} it still does not fit: "
                    f"{'; '.join(est.reasons)}; plan for a larger machine (--gpu-memory, --host-memory) "
                    f"or a smaller model")


def resolve_activation_checkpointing(plan: RunPlan, machine: Machine | None = None,
                                     notes: list[str] | None = None) -> bool:
    """``train.activation_checkpointing`` as a bool; ``auto`` is on when the plan does not fit
    without it and fits better with it (a plan short of host RAM on a GPU machine gains nothing
    from it: the activations live on the device); an unknown model size: off. Sets the plan's
    field to the result."""
    value = plan.train.activation_checkpointing
    if value != "auto":
        return bool(value)
    machine = machine or target_machine(plan.machine)
    est = estimate(with_sets(plan, {"train.activation_checkpointing": False}), machine)
    on = False
    if est.size is not None and not est.fits:
        e = estimate(with_sets(plan, {"train.activation_checkpointing": True}), machine)
        on = shortfall(e) < shortfall(est)
    plan.train.activation_checkpointing = on
    if notes is not None and on:  # off needs no line: the printed plan says false
        notes.append(f"train.activation_checkpointing (auto): on, the plan does not fit without it; activations "
                     f"{est.item('activations (rough)') / GB:.2f} GB -> {e.item('activations (rough)') / GB:.2f} GB")
    return on
