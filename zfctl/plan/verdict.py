"""Whether a machine holds a plan's lines: the margins, the host RAM a plan may use, the reasons.

Split from zfctl/plan/memory.py by concern; ``estimate`` there calls ``_verdict`` with its
totals, and zfctl/plan/fit.py measures a shortfall against the same ``DEVICE_MARGIN`` and
``host_limit``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zfctl.plan.machine import GB, Machine

if TYPE_CHECKING:
    from zfctl.plan.lines import MemoryItem

DEVICE_MARGIN = 0.05  # the verdict keeps 5% of the GPU for the allocator's fragmentation
HOST_RESERVE = 15 * GB  # left for the OS, the page cache, data and Python (a quarter of a smaller machine)


def host_limit(machine: Machine) -> float:
    """Host RAM the plan may use: all but ``HOST_RESERVE`` (a quarter of a machine under 60 GB)."""
    return machine.host_ram - min(HOST_RESERVE, 0.25 * machine.host_ram)


def _largest(items: list[MemoryItem], where: set[str]) -> str:
    top = sorted((i for i in items if i.where in where), key=lambda i: -i.bytes)[:3]
    return ", ".join(f"{i.name} {i.bytes / GB:.1f} GB" for i in top)


def _verdict(items: list[MemoryItem], device_kind: str, device_total: float, node_host: float,
             machine: Machine, requested: str, per_node: int) -> list[str]:
    """Why the machine cannot run the plan ([] = it fits), naming the largest lines. ``node_host``:
    the host RAM one node needs (its ``per_node`` ranks' host lines)."""
    reasons = []
    if requested == "cuda" and not machine.cuda:
        reasons.append("train.device is cuda but the machine has no CUDA device")
    if device_kind == "cuda" and machine.cuda and device_total > (1 - DEVICE_MARGIN) * machine.gpu_mem:
        reasons.append(
            f"device memory: needs {device_total / GB:.1f} GB, {machine.gpu_name} has "
            f"{machine.gpu_mem / GB:.1f} GB (largest: {_largest(items, {'device'})})"
        )
    host_need = node_host
    limit = host_limit(machine)
    if machine.host_ram and host_need > limit:
        where = {"host"} if device_kind == "cuda" else {"host", "device"}
        ranks = f" for {per_node} ranks" if per_node > 1 else ""
        reasons.append(
            f"host RAM: needs {host_need / GB:.1f} GB{ranks}, the machine has {machine.host_ram / GB:.1f} GB of which "
            f"{limit / GB:.1f} GB may be used (largest: {_largest(items, where)})"
        )
    return reasons
