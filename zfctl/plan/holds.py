"""The run's check that this machine still holds its plan, before anything is allocated.

The plan decided every ``auto`` for the machine it names (settle.py); the run builds exactly that
and never re-decides. What it checks, per rank, is that this machine is not smaller than the one
planned for, against the smaller of the planned size and what it finds now:

* device: what the GPU this rank trains on (``torch.cuda.mem_get_info(device)``, not GPU 0) offers
  this process now (free, plus what the process already holds: its CUDA context, which the plan
  counts as a line, and torch's reserve), under torch's per-process fraction; the plan's device
  total must stay within ``1 - DEVICE_MARGIN`` of it, as in the plan's verdict;
* host: ``MemAvailable`` plus this process's resident set (the plan's ``process baseline`` line
  counts the process itself), under the process's memory cap (cgroup, RLIMIT: machine.py
  ``process_memory_cap``); the node's host total must fit it. Ranks of one node that start
  together each see the others' start-up RSS as used: the check errs on the safe side by about
  a baseline per rank.

Only a machine smaller than the plan's is refused: a plan that did not fit its own machine was
already said so in its printout (``zfctl plan``, the verdict under ``zfctl finetune``'s plan),
and the estimate is rough where it is (activations). A refusal is one ``UserError`` line naming
the planned and found sizes and the fix; a plan whose model size is unknown is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zfctl.errors import UserError
from zfctl.plan import machine as machine_mod
from zfctl.plan.lines import CUDA_CONTEXT
from zfctl.plan.machine import GB
from zfctl.plan.memory import MemoryEstimate, estimate
from zfctl.plan.schema import RunPlan
from zfctl.plan.verdict import DEVICE_MARGIN, host_limit

if TYPE_CHECKING:
    import torch


@dataclass
class Found:
    """What this rank finds now (None: unknown, not checked)."""

    device: str  # the GPU this rank trains on, in words; "" on CPU
    gpu_bytes: float | None  # device memory this process may still hold, its context included
    gpu_why: str  # how gpu_bytes was found
    host_bytes: float | None  # host RAM this process (and its node's ranks) may hold
    host_why: str


def found_here(device: torch.device) -> Found:
    """The sizes this rank can use now, on ``device`` (its own GPU) and the host."""
    import torch

    gpu: float | None = None
    name, gpu_why = "", ""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)  # creates this process's context on that GPU
        # This process's context is already made (mem_get_info needs one) and torch may have
        # reserved some: both are in the plan's lines, so they count as held, not as taken.
        gpu = float(free) + float(torch.cuda.memory_reserved(index)) + CUDA_CONTEXT
        name, gpu_why = f"cuda:{index}", "free now"
        fraction = machine_mod.memory_fraction(index)
        if fraction < 1.0 and fraction * total + CUDA_CONTEXT < gpu:
            gpu, gpu_why = fraction * total + CUDA_CONTEXT, f"torch's per-process cap, {fraction:.3g} of {total / GB:.1f} GB"
    from zfctl.offload.cpu.host import available_ram

    avail = available_ram()
    host = None if avail is None else avail + _resident_bytes()
    host_why = "available now"
    cap = machine_mod.process_memory_cap()
    if cap is not None and (host is None or cap < host):
        host, host_why = cap, "the process's memory cap (cgroup, RLIMIT)"
    return Found(name, gpu, gpu_why, host, host_why)


def _resident_bytes() -> float:
    """This process's resident set now (``VmRSS``; 0 where /proc does not say)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def check_holds(plan: RunPlan, device: torch.device, *, resume: str | None = None) -> MemoryEstimate:
    """Raise a one-line UserError when this machine cannot hold what ``plan`` planned (module
    docstring); return the plan's estimate. ``device``: the one this rank trains on. ``resume``:
    the run folder of a ``zfctl resume``, whose fix is an edited plan.yaml, not a flag."""
    est = estimate(plan)  # the plan's own machine: machine.* where given, else this one's capacities
    if est.size is None:
        return est
    found = found_here(device)
    problems = []
    planned = est.machine
    if device.type == "cuda" and est.device_kind == "cuda" and planned.cuda and found.gpu_bytes is not None:
        need, have = est.device_total, found.gpu_bytes
        if have < planned.gpu_mem and need > (1 - DEVICE_MARGIN) * have:
            fix = _device_fix(plan, est, have, resume)
            problems.append(f"device memory: the plan needs {_gb(need)} per GPU (planned for {_gb(planned.gpu_mem)}), "
                            f"{found.device} has {_gb(have)} for this process ({found.gpu_why}), of which "
                            f"{100 * (1 - DEVICE_MARGIN):.0f}% may be used; {fix}")
    if found.host_bytes is not None:
        need = est.node_host_total
        if device.type == "cpu" and est.device_kind == "cuda":  # planned for a GPU, run on the CPU
            need += est.ranks_per_node * est.device_total
        have = found.host_bytes
        usable = host_limit(planned) if planned.host_ram else float("inf")
        if have < usable and need > have:
            per = f" for {est.ranks_per_node} ranks" if est.ranks_per_node > 1 else ""
            fix = _host_fix(plan, est, have, resume)
            problems.append(f"host RAM: the plan needs {_gb(need)}{per} (planned for {_gb(planned.host_ram)}, "
                            f"{_gb(usable)} usable), this machine has {_gb(have)} ({found.host_why}); {fix}")
    if problems:
        raise UserError("this machine cannot hold the plan: " + "; ".join(problems))
    return est


def _device_fix(plan: RunPlan, est: MemoryEstimate, have: float, resume: str | None) -> str:
    acc = est.item("gradient accumulator")
    if resume is not None:
        other = (f"set zenflow.accumulate: host in {resume}/plan.yaml ({_gb(acc)} less on the device) and resume "
                 "with --allow-changes, or " if acc else "")
        return f"{other}resume on a GPU with {_gb(est.device_total / (1 - DEVICE_MARGIN))} free"
    replan = f"re-plan for it: --gpu-memory {have / GB:.1f}GB --fit"
    if acc:
        return f"{replan}, or --set zenflow.accumulate=host ({_gb(acc)} less on the device)"
    return replan


def _host_fix(plan: RunPlan, est: MemoryEstimate, have: float, resume: str | None) -> str:
    if resume is not None:
        return f"resume where {_gb(est.node_host_total)} of RAM is available"
    replan = f"re-plan for it: --host-memory {have / GB:.1f}GB --fit"
    if est.grad_layout == "slots" and est.accumulate == "host" and est.item("gradient slots"):
        # the carry holds 4 B per host element (the master's 4) and a small ring instead of the slots
        less = est.item("gradient slots") - est.item("fp32 master")
        if less > 0:
            return f"{replan}, or --set zenflow.tuning.grad_layout=carry (about {_gb(less)} less)"
    return replan


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB" if x < 10 * GB else f"{x / GB:.1f} GB"
