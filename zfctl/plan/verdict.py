"""Whether a machine holds a plan's lines: the margins, the host RAM a plan may use, the reasons.

Split from zfctl/plan/memory.py by concern; ``estimate`` there calls ``_verdict`` with its
totals and :func:`shortfall` to rank the host layouts it tries (layouts.py), and
zfctl/plan/fit.py measures the same shortfall. It imports the lines' ``MemoryItem`` from
items.py, never from lines.py, which imports ``host_limit`` from here.
"""

from __future__ import annotations

from zfctl.plan.items import NO_MODEL_FITS, MemoryItem
from zfctl.plan.machine import GB, Machine

DEVICE_MARGIN = 0.05  # the verdict keeps 5% of the GPU for the allocator's fragmentation
HOST_RESERVE = 15 * GB  # left for the OS, the page cache, data and Python (a quarter of a smaller machine)


def host_limit(machine: Machine) -> float:
    """Host RAM the plan may use: all but ``HOST_RESERVE`` (a quarter of a machine under 60 GB)."""
    return machine.host_ram - min(HOST_RESERVE, 0.25 * machine.host_ram)




def gb(x: float) -> str:
    """Bytes as the memory table prints them: 2 decimals under 10 GB, 1 above."""
    return f"{x / GB:,.2f} GB" if x < 10 * GB else f"{x / GB:,.1f} GB"


def gb_apart(*sizes: float, decimals: int = 1) -> list[str]:
    """``sizes`` as "X GB", all with ``decimals`` decimals or as many more as it takes for two
    different sizes to read differently (1.15 GB needed of 1.125 GB: "1.15 GB" and "1.12 GB",
    never "1.1 GB" twice); 9 decimals are bytes."""
    for d in range(decimals, 10):
        texts = [f"{x / GB:,.{d}f} GB" for x in sizes]
        if len(set(texts)) == len(set(sizes)):
            break
    return texts


def host_figures(need: float, machine: Machine) -> tuple[str, str, str]:
    """The host RAM a plan needs, the machine's and what the plan may use of it, as the verdict
    and the "checked against" line print them (:func:`gb_apart`: they never read alike)."""
    need_s, ram_s, limit_s = gb_apart(need, machine.host_ram, host_limit(machine))
    return need_s, ram_s, limit_s


def baseline_short(baseline: float, machine: Machine, per_node: int, *, cuda: bool) -> str | None:
    """The reason no model fits when ``baseline`` (the host RAM the node's processes hold before
    any buffer of the run, zfctl/plan/lines.py PROCESS_BASELINE) is more than the host may use;
    None when it is not (or the host size is unknown)."""
    limit = host_limit(machine)
    if not machine.host_ram or baseline <= limit:
        return None
    need_s, limit_s, ram_s = gb_apart(baseline, limit, machine.host_ram, decimals=2)
    who = f"the {per_node} processes alone need" if per_node > 1 else "the process alone needs"
    libraries = ", CUDA libraries" if cuda else ""
    return (f"{NO_MODEL_FITS}: {who} {need_s} of host RAM (Python, torch, transformers, the tokenizer and "
            f"data{libraries}, before any model), more than the host offers: {limit_s} may be used of its {ram_s}")


def shortfall(device_total: float, node_host: float, device_kind: str, machine: Machine) -> float:
    """Bytes the machine lacks: the device's over its usable share, plus the host's over
    :func:`host_limit` (``node_host``: one node's host RAM, with the device side where there is
    no CUDA)."""
    short = 0.0
    if device_kind == "cuda" and machine.cuda:
        short += max(0.0, device_total - (1 - DEVICE_MARGIN) * machine.gpu_mem)
    if machine.host_ram:
        short += max(0.0, node_host - host_limit(machine))
    return short


def _largest(items: list[MemoryItem], where: set[str]) -> str:
    top = sorted((i for i in items if i.where in where), key=lambda i: -i.bytes)[:3]
    return ", ".join(f"{i.name} {i.bytes / GB:.1f} GB" for i in top)


def _verdict(items: list[MemoryItem], device_kind: str, device_total: float, node_host: float,
             machine: Machine, requested: str, per_node: int, baseline: float = 0.0) -> list[str]:
    """Why the machine cannot run the plan ([] = it fits), naming the largest lines. ``node_host``:
    the host RAM one node needs (its ``per_node`` ranks' host lines); ``baseline``: what those
    ranks hold before any line of the run (more than the host may use: no model fits, the only
    reason given besides a missing CUDA device)."""
    reasons = []
    if requested == "cuda" and not machine.cuda:
        reasons.append("train.device is cuda but the machine has no CUDA device")
    nothing = baseline_short(baseline, machine, per_node, cuda=device_kind == "cuda")
    if nothing is not None:
        return [nothing, *reasons]
    if device_kind == "cuda" and machine.cuda and device_total > (1 - DEVICE_MARGIN) * machine.gpu_mem:
        reasons.append(
            f"device memory: needs {device_total / GB:.1f} GB, {machine.gpu_name} has "
            f"{machine.gpu_mem / GB:.1f} GB (largest: {_largest(items, {'device'})})"
        )
    if machine.host_ram and node_host > host_limit(machine):
        where = {"host"} if device_kind == "cuda" else {"host", "device"}
        ranks = f" for {per_node} ranks" if per_node > 1 else ""
        need_s, ram_s, limit_s = host_figures(node_host, machine)
        why = ""
        if device_kind == "cpu" and per_node == 1:  # the table's host total leaves the device side out
            device_s, host_s = gb(device_total), gb(node_host - device_total)
            why = (f" (the host total {host_s} + the device total {device_s}: without CUDA the device side is "
                   "host RAM)")
        reasons.append(
            f"host RAM: needs {need_s}{ranks}{why}, the machine has {ram_s} of which {limit_s} may be used "
            f"(largest: {_largest(items, where)})"
        )
    return reasons
