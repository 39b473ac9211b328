"""Decide once: every ``auto`` a run would otherwise decide, resolved against the plan's machine and
written into the plan's own fields (docs/design.md, "Defaults and the numbers behind them").

| field | ``auto`` becomes | the rule |
| --- | --- | --- |
| ``train.precision`` | bf16 or fp32 | precision.py (resolve.py applies it when the plan is made) |
| ``train.activation_checkpointing`` | true or false | fit.py ``resolve_activation_checkpointing`` (resolve.py too) |
| ``zenflow.accumulate`` | host or device | the estimate: layouts.py ``choose`` (slots 2 sets > 1 set > carry > device) |
| ``zenflow.tuning.grad_layout`` | slots or carry | the estimate: layouts.py ``choose`` (carry on the device path) |
| ``zenflow.tuning.host_accumulators`` | 1 or 2 | the estimate: layouts.py ``choose`` (1 but for 2 slot sets) |
| ``zenflow.tuning.upload_buffer`` | true or false | the estimate: lines.py ``_upload_buffer`` (false for fp32) |
| ``zenflow.tuning.staging_mb`` | MiB | the estimate: layouts.py ``grow_staging`` (2048 where nothing selects) |
| ``zenflow.tuning.release_grads`` | false where the plan's own settings leave nothing to release | :func:`release_ruled_out` |

``zfctl plan`` and ``zfctl finetune`` settle the plan after ``--fit`` (which searches with ``auto``
in place, so the answers are the fitted plan's), print it and save it as ``plan.yaml``; ``zfctl
resume`` reads the answers back and settles, once, a ``plan.yaml`` of an earlier zfctl that still
says ``auto``. Every answer comes from the plan's machine: ``machine.gpu_memory`` /
``machine.host_memory`` where given, else the capacities of this process's GPU and host
(machine.py ``this_machine``), never from what happens to be free, so every rank of a job gets
the same answers. The run builds what the plan says (zfctl/train/optim.py ``build_optimizer``) and
only checks that this machine still holds it (holds.py). A model the plan cannot size before it is
loaded (a hub id alone) keeps ``auto`` until the recipe has built it: then it is settled once with
the model's own shapes (optim.py ``settle_for_model``), before the optimizer exists, and
``plan.yaml`` records that.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Literal

from zfctl.errors import UserError
from zfctl.plan.fit import resolve_activation_checkpointing
from zfctl.plan.layouts import Layout, bytes_per_element
from zfctl.plan.machine import GB, Machine, target_machine
from zfctl.plan.memory import MemoryEstimate, estimate
from zfctl.plan.precision import resolve_for_this_machine
from zfctl.plan.schema import RunPlan
from zfctl.plan.sizes import ModelSize
from zfctl.plan.verdict import gb_apart, host_limit

# (section, field) of what settle() writes, for a comparison that reads `auto` as "not decided yet".
SETTLED = (("train", "precision"), ("train", "activation_checkpointing"), ("zenflow", "accumulate"),
           ("zenflow.tuning", "host_accumulators"), ("zenflow.tuning", "upload_buffer"),
           ("zenflow.tuning", "grad_layout"), ("zenflow.tuning", "staging_mb"))
# The layout fields settle() decides from the estimate (layouts.py choose), all or none.
LAYOUT = ("accumulate", "grad_layout", "host_accumulators", "upload_buffer", "staging_mb")


def unsettled(plan: RunPlan) -> bool:
    """Whether any field :func:`settle` decides still says ``auto``."""
    return any(_get(plan, section, name) == "auto" for section, name in SETTLED)


def settle(plan: RunPlan, machine: Machine | None = None, *, size: ModelSize | None = None,
           notes: list[str] | None = None) -> RunPlan:
    """A copy of ``plan`` with every ``auto`` of :data:`SETTLED` resolved against ``machine``
    (default: the plan's target, ``machine.*`` else this one) and ``release_grads`` off where it
    does not apply (:func:`release_ruled_out`). ``size``: the model's, when the plan cannot say it
    (a built hub model); a model of unknown size keeps ``accumulate`` and ``host_accumulators``
    as they are. ``notes`` gets a line for each decision the memory estimate does not print."""
    plan = copy.deepcopy(plan)
    t, z = plan.train, plan.zenflow
    if t.precision == "auto":  # resolve.py did it for any plan zfctl made: a library plan, an old file
        choice = resolve_for_this_machine(t.precision, t.device)
        t.precision = choice.precision
        if notes is not None:
            notes.append(choice.reason)
    machine = machine or target_machine(plan.machine)
    if t.activation_checkpointing == "auto":
        resolve_activation_checkpointing(plan, machine, notes=notes)
    est: MemoryEstimate | None = None
    if "auto" in (z.accumulate, *(getattr(z.tuning, f) for f in LAYOUT[1:])) or z.tuning.grad_layout == "slots":
        est = estimate(plan, machine, size=size)
        if est.size is not None:
            check_layout(plan, est, machine, size=size)
            if z.accumulate == "auto":
                z.accumulate = est.accumulate
            for name in LAYOUT[1:]:
                if getattr(z.tuning, name) == "auto":
                    setattr(z.tuning, name, getattr(est, name))
    if z.tuning.release_grads:
        why = release_ruled_out(plan, est if est is not None and est.size is not None else None, size=size,
                                machine=machine)
        if why:
            z.tuning.release_grads = False
            if notes is not None:
                notes.append(f"zenflow.tuning.release_grads: false, nothing to release ({why})")
    return plan


def check_layout(plan: RunPlan, est: MemoryEstimate, machine: Machine, *, size: ModelSize | None = None) -> None:
    """``zenflow.tuning.grad_layout: slots`` given on a host that cannot hold the slots: one
    UserError line (exit 2), before anything is allocated, naming the sizes and the layout that
    fits (carry); where no layout fits the host, the verdict says so instead. ``auto`` never gets
    here (it takes carry where slots do not fit: layouts.py)."""
    z = plan.zenflow
    if (z.tuning.grad_layout != "slots" or est.accumulate != "host" or est.fits
            or not any(r.startswith("host RAM") for r in est.reasons)):
        return
    slots = est.item("gradient slots")
    lean = estimate(with_layout(plan, "carry"), machine, size=size)
    need, usable, ram = gb_apart(est.node_host_total, host_limit(machine), machine.host_ram,
                                 decimals=2 if machine.host_ram < 10 * GB else 1)
    head = (f"zenflow.tuning.grad_layout=slots: this host cannot hold the gradient slots ({_gb(slots)}, "
            f"{bytes_per_element(plan, Layout('host', 'slots', est.host_accumulators))} B per host element per "
            f"interval): the plan needs {need} of host RAM, {usable} of {ram} may be used")
    if any(r.startswith("host RAM") for r in lean.reasons):
        return  # no layout fits this host: the verdict says so, and --fit what else would
    raise UserError(f"{head}; grad_layout carry (4 B per host element per interval, host "
                    f"{_gb(lean.node_host_total)}) fits: --set zenflow.tuning.grad_layout=carry (or auto)")


def with_layout(plan: RunPlan, layout: Literal["slots", "carry"]) -> RunPlan:
    """``plan`` with ``zenflow.tuning.grad_layout`` set (its other fields as they are)."""
    return replace(plan, zenflow=replace(plan.zenflow, tuning=replace(plan.zenflow.tuning, grad_layout=layout)))


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB" if x < 10 * GB else f"{x / GB:.1f} GB"


def release_ruled_out(plan: RunPlan, est: MemoryEstimate | None = None, *, size: ModelSize | None = None,
                      machine: Machine | None = None) -> str:
    """Why ``zenflow.tuning.release_grads`` cannot apply to ``plan`` whatever machine and world size
    run it ("" when it may). It frees each gradient in a hook of the hook path (zfctl/offload/
    optimizer.py ``_build_release``): under ``update_interval: auto`` the interval rule reads every
    ``.grad`` in ``step()``, and with host columns summed on the device (``accumulate: device``)
    there is no hook path. The world-size reasons (FSDP2 shards, no host columns on several ranks)
    are left out: a resume may change the world size, and the plan's estimate counts them as they
    come (lines.py ``_released_gradients``)."""
    z = plan.zenflow
    if z.update_interval == "auto":
        return "update_interval: auto reads every .grad in step()"
    if z.accumulate != "device":  # the hook path (or auto: not decided yet)
        return ""
    if float(z.topk_ratio) >= 1:
        return ""  # no host columns: the release hooks free every matrix's .grad (one process)
    if est is None:
        est = estimate(plan, machine, size=size)
    if est.size is None or est.item("fp32 master") == 0:  # unknown, or no host columns after all
        return ""
    return "accumulate: device sums the host columns on the device"


def adopt_resolved(saved: RunPlan, current: RunPlan) -> RunPlan:
    """``saved`` with each field :func:`settle` decides taken from ``current`` where ``saved`` still
    says ``auto`` and ``current`` has an answer: a checkpoint of an earlier zfctl beside a run
    folder's ``plan.yaml`` that a later resume settled is the same plan, not an edit."""
    out = copy.deepcopy(saved)
    for section, name in SETTLED:
        if _get(saved, section, name) == "auto" and _get(current, section, name) != "auto":
            setattr(_section(out, section), name, _get(current, section, name))
    return out


def _section(plan: RunPlan, dotted: str) -> object:
    obj: object = plan
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _get(plan: RunPlan, section: str, name: str) -> object:
    return getattr(_section(plan, section), name)
