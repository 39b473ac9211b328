"""The host gradient layouts (``zenflow.tuning.grad_layout``), and the ``auto`` choices that
depend on them, resolved against the host and the device together.

Where an interval's host-owned gradient waits for its CPU update, per host-column element for one
interval (``U`` = update_interval, or ``auto_max_interval`` under ``auto``; ``w`` the model
dtype's bytes), fastest first (``ORDER``):

| layout | host | device | what it costs besides memory |
| --- | --- | --- | --- |
| slots, 2 sets | 2 U w | | nothing: the next interval lands in the other set |
| slots, 1 set | U w | | the next interval's writes wait for the CPU update to have read each chunk |
| carry | 4 + a landing ring | | one fp32 sum, each landed chunk folded in as it arrives |
| ``accumulate: device`` | 4 | 4 | the interval's sum on the device, copied to the host once |

``choose`` takes the first that fits both the host and the device, a resume inside an interval
included (``resume_fits``: under slots it holds a 4 B fp32 carry; an explicit ``grad_layout:
slots`` gets a note instead) (the device accumulator only
where the device holds it within ``AUTO_DEVICE_SHARE``, as ``accumulate: auto`` always did);
what the plan fixes (an explicit ``accumulate``, ``grad_layout`` or ``host_accumulators``)
narrows the list. Where none fits, the one that comes closest, so the verdict and ``--fit`` start
from it. The upload buffer (lines.py ``_upload_buffer``) and the selection's out buffer
(:func:`grow_staging`) take what is left after the layout, in that order. Every estimate is the
whole plan's (memory.py), so a line added anywhere counts in the choice.

A checkpoint inside an interval streams its partial sum into the file (no resident line);
resumed under ``slots`` the sum is held as an fp32 carry for that interval only (4 B per host
element, a note: ``resume_note``), under ``carry`` it is the carry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from zfctl.offload.sizing import AUTO_DEVICE_SHARE, STAGE_BYTES, slots_per_set
from zfctl.plan.items import MemoryEstimate, MemoryItem
from zfctl.plan.machine import GB, Machine
from zfctl.plan.schema import RunPlan
from zfctl.plan.verdict import host_limit, shortfall

# The out buffer takes this share of what the host has to spare after every other line: it saves
# a selection's wait, never memory, and the rest of the spare is margin for what the plan
# estimates roughly (the process baseline, the activations). A quarter keeps llama2-7b's carry plan
# on 128 GB within 16.5 B per parameter (tests/plan/test_fits_contract.py).
STAGING_SHARE = 0.25


@dataclass(frozen=True)
class Layout:
    """One way to hold an interval's host-owned gradient."""

    accumulate: Literal["host", "device"]
    grad_layout: Literal["slots", "carry"]  # the device path's host side is one fp32 sum: "carry"
    sets: int  # slot sets (zenflow.tuning.host_accumulators)

    def words(self) -> str:
        if self.accumulate == "device":
            return "accumulate: device"
        return f"slots, {self.sets} set{'s' if self.sets > 1 else ''}" if self.grad_layout == "slots" else "carry"


ORDER = (Layout("host", "slots", 2), Layout("host", "slots", 1), Layout("host", "carry", 1),
         Layout("device", "carry", 1))


def carry_bytes(host_elems: int, ring_slots: int, slot_bytes: int) -> tuple[float, float]:
    """The carry layout's host bytes: (the fp32 carry, 4 B per host element; the landing ring,
    ``ring_slots`` x ``slot_bytes`` of the model dtype), both page-locked on CUDA."""
    return 4.0 * host_elems, float(ring_slots * slot_bytes)


def bytes_per_element(plan: RunPlan, lay: Layout) -> int:
    """Host bytes per host-column element for one interval's gradient under ``lay``."""
    z = plan.zenflow
    if lay.accumulate == "device" or lay.grad_layout == "carry":
        return 4
    w = 4 if plan.train.precision == "fp32" else 2
    return lay.sets * w * slots_per_set(z.update_interval, z.tuning.auto_max_interval)


def candidates(plan: RunPlan, device_kind: str) -> list[Layout]:
    """``ORDER`` narrowed by what the plan fixes, fastest first."""
    z = plan.zenflow
    tu = z.tuning
    out: list[Layout] = []
    for lay in ORDER:
        if z.accumulate not in ("auto", lay.accumulate):
            continue
        if lay.accumulate == "device" and z.accumulate == "auto" and (device_kind != "cuda" or tu.grad_layout != "auto"):
            continue  # no device to sum on, or a host layout was asked for
        if lay.accumulate == "host" and tu.grad_layout not in ("auto", lay.grad_layout):
            continue
        layout: Literal["slots", "carry"] = lay.grad_layout if tu.grad_layout == "auto" else tu.grad_layout
        if tu.host_accumulators != "auto":
            sets = int(tu.host_accumulators)  # kept as given (carry and the device path have no sets)
        else:
            sets = lay.sets if layout == "slots" and lay.accumulate == "host" and z.overlap_step else 1
        cand = Layout(lay.accumulate, layout, sets)
        if cand not in out:
            out.append(cand)
    return out


def applied(plan: RunPlan, lay: Layout) -> RunPlan:
    """``plan`` with ``lay``'s three fields set."""
    z = plan.zenflow
    tuning = replace(z.tuning, grad_layout=lay.grad_layout, host_accumulators=lay.sets)
    return replace(plan, zenflow=replace(z, accumulate=lay.accumulate, tuning=tuning))


def choose(plan: RunPlan, machine: Machine, device_kind: str,
           build: Callable[[RunPlan], MemoryEstimate]) -> MemoryEstimate:
    """The estimate of ``plan`` under the first layout of :func:`candidates` that fits (module
    docstring), with notes saying what was chosen and what the others would cost."""
    tried: list[tuple[Layout, MemoryEstimate]] = []
    chosen = None
    for lay in candidates(plan, device_kind):
        est = build(applied(plan, lay))
        tried.append((lay, est))
        device_ok = (lay.accumulate == "host" or plan.zenflow.accumulate == "device" or
                     est.device_total <= AUTO_DEVICE_SHARE * machine.gpu_mem)
        if est.fits and device_ok and (plan.zenflow.tuning.grad_layout != "auto" or resume_fits(est)):
            chosen = (lay, est)
            break
    if chosen is None:  # none fits: the one that comes closest (the first of equals)
        chosen = min(tried, key=lambda t: _short(t[1]))
    lay, est = chosen
    if est.size is not None and est.item("fp32 master"):
        est.notes[:0] = _notes(plan, lay, est, tried)
    return est


def _short(est: MemoryEstimate) -> float:
    return shortfall(est.device_total, est.node_host_total, est.device_kind, est.machine)


def _notes(plan: RunPlan, lay: Layout, est: MemoryEstimate, tried: list[tuple[Layout, MemoryEstimate]]) -> list[str]:
    """What ``choose`` decided, for the fields the plan left ``auto``, and what the layout costs."""
    z, out = plan.zenflow, []
    tu = z.tuning
    auto = " (auto)" if tu.grad_layout == "auto" else ""
    if lay.accumulate == "host":
        others = [f"{o.words()} ({bytes_per_element(plan, o)} B, {_gb(_layout_bytes(e))}"
                  f"{'' if not e.fits or resume_fits(e) else f'; with a resume carry of {_gb(e.resume_carry)}'})"
                  for o, e in tried if o != lay]
        why = f"; does not fit: {'; '.join(others)}" if others else ""
        short = any(r.startswith("host RAM") for r in est.reasons)
        closest = " (the host holds no layout: the closest)" if short else ""
        out.append(f"zenflow.tuning.grad_layout{auto}: {lay.grad_layout}{closest}, {bytes_per_element(plan, lay)} B "
                   f"per host element per interval ({_layout_text(est)}){why}")
    if z.accumulate == "auto" or lay.accumulate == "device":
        acc = est.item("fp32 master")  # the device's fp32 sum: 4 B per host element, as the master
        how = " (auto)" if z.accumulate == "auto" else ""
        out.append(f"zenflow.accumulate{how}: {lay.accumulate}; the device accumulator costs {acc / GB:.2f} GB of "
                   f"device memory, {'used' if lay.accumulate == 'device' else 'not used'}")
    if tu.host_accumulators == "auto" and lay.grad_layout == "slots" and lay.accumulate == "host" and z.overlap_step:
        one = est.item("gradient slots") / lay.sets
        out.append(f"zenflow.tuning.host_accumulators (auto): {lay.sets}; a second set of gradient slots costs "
                   f"{one / GB:.2f} GB of host memory, {'used' if lay.sets == 2 else 'not used: it does not fit'}")
    resume = resume_note(plan, est)
    if resume:
        out.append(resume)
    return out


def _layout_bytes(est: MemoryEstimate) -> float:
    return sum(est.item(n) for n in ("gradient slots", "gradient carry", "landing ring", "gradient accumulators"))


def _layout_text(est: MemoryEstimate) -> str:
    lines = [i for i in est.items if i.name in ("gradient slots", "gradient carry", "landing ring",
                                                "gradient accumulators")]
    return " + ".join(f"{i.name} {_gb(i.bytes)}" for i in lines)


def resume_fits(est: MemoryEstimate) -> bool:
    """The host also holds a resume's fp32 carry beside the plan (slots only; an unknown host
    holds it): ``auto`` takes slots only where a resume inside an interval fits too, since a run
    that fits but cannot resume on its own machine does not fit."""
    if not est.resume_carry or not est.machine.host_ram:
        return True
    return host_limit(est.machine) - est.node_host_total >= est.resume_carry * est.ranks_per_node


def resume_note(plan: RunPlan, est: MemoryEstimate) -> str:
    """Under slots, a checkpoint resumed inside an interval holds that interval's sum as an fp32
    carry until its update: transient, not a line (module docstring)."""
    if not est.resume_carry:
        return ""
    spare = host_limit(est.machine) - est.node_host_total if est.machine.host_ram else None
    fits = "" if spare is None else (f"; the host has {_gb(spare)} to spare" if spare >= est.resume_carry * est.ranks_per_node
                                     else f"; more than the {_gb(max(spare, 0.0))} the host has to spare: resume "
                                     "at an interval's boundary, or --set zenflow.tuning.grad_layout=carry")
    return (f"a resume inside an interval under slots holds that interval's fp32 sum as a carry until its update: "
            f"4 B per host element, {_gb(est.resume_carry)}, transient (not in the host total){fits}")


def layout_lines(plan: RunPlan, host_elems: int, slot_bytes: int, items: list[MemoryItem], pinned: str) -> None:
    """The host lines of the plan's (decided) layout: the gradient slots, the carry and its
    landing ring, or the device path's fp32 sum."""
    z, t = plan.zenflow, plan.train
    tu = z.tuning
    w = 4 if t.precision == "fp32" else 2
    if z.accumulate == "device":
        items.append(MemoryItem("host", "gradient accumulators", 4.0 * host_elems, "1 x fp32: the device path "
                                "lands each interval's sum here once, 4 B per host element per interval" + pinned,
                                "zfctl/offload/grads/slots.py GradSlots (sum_buffer)"))
        return
    if tu.grad_layout == "carry":
        carry, ring = carry_bytes(host_elems, tu.ring_slots, slot_bytes)
        items.append(MemoryItem("host", "gradient carry", carry, "grad_layout carry: one fp32 sum, 4 B per host "
                                "element per interval, each landed chunk folded in as it arrives" + pinned,
                                "zfctl/offload/grads (the carry layout)"))
        items.append(MemoryItem("host", "landing ring", ring, f"{tu.ring_slots} x {slot_bytes / 2**20:.3g} MiB "
                                f"{t.precision} slots the gradient lands in before its fold" + pinned,
                                "zfctl/offload/grads (the carry layout's ring)"))
        return
    per = slots_per_set(z.update_interval, tu.auto_max_interval)
    n = int(tu.host_accumulators) if z.overlap_step and tu.host_accumulators != "auto" else 1
    if not z.overlap_step:
        how = f"1 set of {per} slots: one interval (the step waits for the CPU update)"
    elif n == 2:
        how = (f"2 sets of {per} slots: overlap_step: the next interval lands in one while the CPU update reads "
               "the other")
    else:
        how = (f"1 set of {per} slots: overlap_step: the next interval's writes wait for the CPU update to have "
               "read each chunk")
    items.append(MemoryItem("host", "gradient slots", float(n * per * w * host_elems),
                            f"{how}; {n * per * w} B per host element per interval" + pinned,
                            "zfctl/offload/grads/slots.py GradSlots"))


def grow_staging(plan: RunPlan, items: list[MemoryItem], room: float, node_host: float, machine: Machine,
                 per_node: int, resume: float = 0.0) -> float:
    """``zenflow.tuning.staging_mb: auto``: the selection's out buffer, placed by lines.py at one
    packed piece, grows by up to ``room`` bytes (to every leaving row, at most 2 GiB) into
    ``STAGING_SHARE`` of what the host has to spare after every other line; returns its cap in
    whole MiB (what the plan records and the engine reads: sizing.py ``staging_cap``)."""
    line = next((i for i in items if i.name == "selection staging"), None)
    if line is None:
        return 2048.0
    # what a resume's carry needs stays free (resume_fits)
    spare = (host_limit(machine) - node_host) / per_node - resume if machine.host_ram else room
    grow = min(room, max(0.0, STAGING_SHARE * spare))
    cap_mb = float((STAGE_BYTES + int(grow)) // 2**20)
    if grow >= room:  # every leaving row fits: the largest cap (the engine takes the smaller)
        cap_mb = 2048.0
    else:
        grow = cap_mb * 2**20 - STAGE_BYTES
    line.bytes += grow
    line.note = staging_note(cap_mb, " (page-locked, exact size)" if "page-locked" in line.note else "")
    return cap_mb


def staging_note(cap_mb: float, pinned: str) -> str:
    """The selection staging line's note, its out buffer capped at ``cap_mb`` MiB."""
    return (f"a selection's column migration: in ring, out buffer (leaving rows, at most {cap_mb:g} MiB: "
            f"zenflow.tuning.staging_mb; more wait for it to drain), ids" + pinned)


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB" if x < 10 * GB else f"{x / GB:.1f} GB"
