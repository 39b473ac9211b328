"""Rich rendering of a RunPlan and its memory estimate (`zfctl plan`, and at the start of a run).

Values that differ from the schema default are highlighted, so the printed plan reads as "what
this run changes"; defaults are dimmed but still shown: the printout is the complete plan.
"""

from __future__ import annotations

from dataclasses import fields

from rich.console import Console
from rich.table import Table
from rich.text import Text

from zfctl.plan.io import plan_to_dict
from zfctl.plan.memory import GB, MemoryEstimate
from zfctl.plan.schema import SECTIONS, RunPlan


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
        for f in fields(cls):
            value = data[name][f.name]
            changed = value != defaults[name][f.name]
            table.add_row(f"  {f.name}", Text(short_value(value), style="bold" if changed else "dim"))
    return table


def print_plan(plan: RunPlan, console: Console) -> None:
    """Print the full resolved plan."""
    console.print(plan_table(plan))


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB" if x < 10 * GB else f"{x / GB:,.1f} GB"


def memory_table(est: MemoryEstimate) -> Table:
    """Per-item device and host memory, with totals."""
    here = "" if est.device_kind == "cuda" else " (no CUDA here: the device side would use host RAM)"
    table = Table(title=f"memory estimate{here}", title_justify="left")
    table.add_column("where")
    table.add_column("what")
    table.add_column("size", justify="right")
    table.add_column("how", style="dim", overflow="fold")
    for item in est.items:
        table.add_row(item.where, item.name, _gb(item.bytes), item.note)
    table.add_row("", Text("device total", style="bold"), Text(_gb(est.device_total), style="bold"), "")
    table.add_row("", Text("host total", style="bold"), Text(_gb(est.host_total), style="bold"), "")
    return table


def print_memory(est: MemoryEstimate, console: Console) -> None:
    """The estimate, this machine, and a one-line verdict (red when it cannot run here)."""
    if est.size is not None:
        console.print(memory_table(est))
    m = est.machine
    gpu = f"{m.gpu_name}, {m.gpu_mem / GB:.1f} GB" if m.cuda else "no CUDA device"
    console.print(f"this machine: {m.host_ram / GB:.1f} GB RAM, {gpu}")
    for note in est.notes:
        console.print(Text(f"note: {note}", style="yellow"))
    if est.size is None:
        return
    if est.fits:
        console.print(Text("this machine can run it", style="bold green"))
    else:
        console.print(Text("this machine cannot run it: " + "; ".join(est.reasons), style="bold red"))
