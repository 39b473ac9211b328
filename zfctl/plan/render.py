"""Rich rendering of a RunPlan and its memory estimate (`zfctl plan`, and at the start of a run).

Values that differ from the schema default are highlighted, so the printed plan reads as "what
this run changes"; defaults are dimmed but still shown: the printout is the complete plan.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from zfctl.plan.coerce import field_types
from zfctl.plan.io import plan_to_dict
from zfctl.plan.machine import GB
from zfctl.plan.memory import MemoryEstimate
from zfctl.plan.schema import SECTIONS, RunPlan
from zfctl.plan.verdict import gb, host_figures

if TYPE_CHECKING:  # for the annotations only
    from zfctl.plan.fit import FitResult


def short_value(value: object, limit: int = 90) -> str:
    """A one-line, YAML-flavoured rendering of a value (null, [a, b], {k: v})."""
    if isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    elif isinstance(value, list):
        text = "[" + ", ".join(str(v) for v in value) + "]"
    elif value is None:
        text = "null"
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plan_table(plan: RunPlan) -> Table:
    """One table, a block per section; non-default values bold."""
    data = plan_to_dict(plan)
    defaults = plan_to_dict(RunPlan())
    table = Table(title="run plan", show_header=False, box=None, pad_edge=False, title_justify="left")
    table.add_column("key", style="cyan", no_wrap=True)
    table.add_column("value", overflow="fold")
    for name, cls in SECTIONS.items():
        table.add_row(Text(name, style="bold magenta"), "")
        _rows(table, cls, data[name], defaults[name], "  ")
    return table


def _rows(table: Table, cls: type, values: dict, defaults: dict, indent: str) -> None:
    """A section's keys; a nested section (zenflow.tuning) as its own block one level deeper."""
    for f in fields(cls):
        value = values[f.name]
        tp = field_types(cls)[f.name][0]
        if isinstance(tp, type) and is_dataclass(tp):
            table.add_row(Text(f"{indent}{f.name}", style="magenta"), "")
            _rows(table, tp, value, defaults[f.name], indent + "  ")
            continue
        changed = value != defaults[f.name]
        table.add_row(f"{indent}{f.name}", Text(short_value(value), style="bold" if changed else "dim"))


def print_plan(plan: RunPlan, console: Console) -> None:
    """Print the full resolved plan."""
    console.print(plan_table(plan))


_gb = gb  # as the verdict's lines print sizes (zfctl/plan/verdict.py)


def memory_table(est: MemoryEstimate) -> Table:
    """Per-item device and host memory, with totals."""
    here = "" if est.device_kind == "cuda" else " (no CUDA: the device side would use host RAM)"
    table = Table(title=f"memory estimate{here}", title_justify="left")
    table.add_column("where")
    table.add_column("what")
    table.add_column("size", justify="right")
    table.add_column("how", style="dim", overflow="fold")
    for item in est.items:
        table.add_row(item.where, item.name, _gb(item.bytes), item.note)
    if est.world_size == 1:
        table.add_row("", Text("device total", style="bold"), Text(_gb(est.device_total), style="bold"), "")
        table.add_row("", Text("host total", style="bold"), Text(_gb(est.host_total), style="bold"), "")
        return table
    r = est.ranks_per_node
    nodes = est.world_size // r
    how = f"{est.strategy} over {est.world_size} ranks ({nodes} node{'s' if nodes > 1 else ''} x {r})"
    table.add_row("", Text("device total per GPU", style="bold"), Text(_gb(est.device_total), style="bold"), how)
    table.add_row("", Text("host total per rank", style="bold"), Text(_gb(est.host_total), style="bold"), "")
    table.add_row("", Text("host total per node", style="bold"), Text(_gb(est.node_host_total), style="bold"),
                  f"{r} ranks" + (" (+ their device side: no CUDA)" if est.device_kind == "cpu" else ""))
    return table


def machine_line(est: MemoryEstimate) -> str:
    """What the estimate was checked against: this machine, or the plan's target sizes."""
    m = est.machine
    gpu = f"{m.gpu_name}, {m.gpu_mem / GB:.1f} GB" if m.cuda else "no CUDA device"
    _, ram, usable = host_figures(est.node_host_total, m)  # the figures the verdict prints, alike
    return f"checked against: {ram} RAM ({usable} usable), {gpu}"


def verdict_line(est: MemoryEstimate) -> str:
    """One line: the two totals and whether the machine holds them."""
    if est.size is None:
        return "memory: unknown (set model.params_b)"
    host = est.host_total + (est.device_total if est.device_kind == "cpu" else 0.0)
    dev = f"device {_gb(est.device_total)}, " if est.device_kind == "cuda" else ""
    verdict = "fits" if est.fits else "does not fit: " + "; ".join(est.reasons)
    if est.world_size > 1:
        dev = f"device {_gb(est.device_total)} per GPU, " if est.device_kind == "cuda" else ""
        return (f"memory ({est.strategy}, {est.world_size} ranks): {dev}host {_gb(est.node_host_total)} per node "
                f"of {est.ranks_per_node} ranks: {verdict}")
    return f"memory: {dev}host {_gb(host)}: {verdict}"


def totals_line(est: MemoryEstimate) -> str:
    """The memory table's totals in one line (per GPU, rank and node for a plan of several ranks)."""
    if est.world_size == 1:
        here = "" if est.device_kind == "cuda" else " (no CUDA: the device side would use host RAM)"
        return f"totals: device {_gb(est.device_total)}, host {_gb(est.host_total)}{here}"
    r = est.ranks_per_node
    return (f"totals: device {_gb(est.device_total)} per GPU, host {_gb(est.host_total)} per rank, "
            f"{_gb(est.node_host_total)} per node ({r} ranks; {est.strategy} over {est.world_size} ranks)")


def print_verdict(est: MemoryEstimate, result: FitResult, console: Console, *, applied: bool) -> None:
    """What `zfctl plan` leads with: the verdict (red when it does not fit, naming the largest
    lines), the totals, the machine they are checked against, what to change (:func:`print_fit`)
    and the estimate's notes; the memory table (:func:`print_memory`) comes below the plan."""
    if est.size is None:
        console.print(verdict_line(est), soft_wrap=True)
    elif est.fits:
        under = f" under {est.strategy} ({est.world_size} ranks)" if est.world_size > 1 else ""
        console.print(Text("it fits" + under, style="bold green"), soft_wrap=True)
    else:
        console.print(Text("it does not fit: " + "; ".join(est.reasons), style="bold red"), soft_wrap=True)
    if est.size is not None:
        console.print(totals_line(est), soft_wrap=True, highlight=False)
    console.print(machine_line(est), soft_wrap=True, highlight=False)
    print_fit(result, console, applied=applied)
    for note in est.notes:
        console.print(Text(f"note: {note}", style="yellow"), soft_wrap=True)


def print_memory(est: MemoryEstimate, console: Console) -> None:
    """The memory estimate's table, a line per buffer (none when the model's size is unknown)."""
    if est.size is not None:
        console.print(memory_table(est))


def advice_lines(result: FitResult) -> list[str]:
    """What to change when the plan does not fit, cheapest first, as ``--set`` flags to paste."""
    if result.before.fits or result.before.size is None or result.before.no_model_fits:
        return []  # no model fits: the verdict says so, and no change of this plan would help
    if not result.fits:
        tried = f" (even {' '.join(c.flags for c in result.changes)} is not enough)" if result.changes else ""
        return [f"no change zfctl can make fits this machine{tried}; plan for a larger machine or a smaller model",
                *result.notes]
    lines = ["to make it fit, add (cheapest first; or pass --fit):"]
    lines += [f"  {c.flags}    # {c.cost}" for c in result.changes]
    m = result.estimate
    dev = f"device {_gb(m.device_total)}, " if m.device_kind == "cuda" else ""
    host = m.host_total + (m.device_total if m.device_kind == "cpu" else 0.0)
    lines.append(f"  -> memory: {dev}host {_gb(host)}")
    return lines


def print_fit(result: FitResult, console: Console, *, applied: bool) -> None:
    """The advice under a plan that does not fit; with --fit (``applied``), what was changed."""
    if applied:
        if result.changes:
            console.print(Text("--fit changed: " + " ".join(c.flags for c in result.changes), style="bold"))
        return
    for line in advice_lines(result):
        console.print(Text(line, style="yellow"), soft_wrap=True)
