"""The benchmark's outputs: two rich tables, a JSON file and a CSV file.

Every file is written to a temporary name next to its destination and renamed into place, so an
interrupted run never leaves a half-written report.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from zfctl.writable import current_umask

DASH = "-"


def fmt_ms(v: float | None) -> str:
    if v is None:
        return DASH
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_bytes(v: float | None) -> str:
    if v is None:
        return DASH
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if v >= size:
            return f"{v / size:.2f} {unit}"
    return f"{v:.0f} B"


def _mm(agg: dict[str, Any]) -> str:
    """'mean / median (n)' or '-' when no step has the quantity."""
    if not agg["n"]:
        return DASH
    return f"{fmt_ms(agg['mean'])} / {fmt_ms(agg['median'])} ({agg['n']})"


def _pct(v: float | None) -> str:
    return DASH if v is None else f"{100 * v:.1f}%"


def _x(v: float | None) -> str:
    return DASH if v is None else f"{v:.2f}x"


def settings_line(meta: dict[str, Any]) -> str:
    """What every row shares beyond the grid: the zenflow preset the rows start from, the --set
    keys on top of it, the dtype and where the interval's sum lives. Printed over the tables and
    the plot, so a table or picture passed around says what it measured."""
    sets = " ".join(f"--set {s}" for s in meta.get("zenflow_set") or [])
    parts = [f"--zenflow {meta.get('zenflow_preset') or '?'}" + (f" {sets}" if sets else ""),
             f"dtype {meta.get('dtype')}", f"accumulate {meta.get('accumulate')}"]
    return ", ".join(parts)


def noise_note(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """How far to trust a difference between rows: the largest spread of one row's per-trial means,
    or, with one trial, that a rerun of the same row can differ by tens of percent."""
    spreads = [(max(t) - min(t)) / min(t) for r in rows if len(t := r.get("trial_overall_ms") or []) > 1
               and min(t) > 0]
    if not spreads:
        return ("timings are noisy (the same `off` row measured 44 and 28 ms in two identical runs on a "
                "shared CPU): compare rows of one run only, and take --trials 3 or more before trusting a "
                "difference under ~30%")
    return (f"the trials of one row differ by up to {100 * max(spreads):.0f}% of their mean step time: "
            "differences between rows smaller than that are noise")


def print_tables(console: Console, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Step-time table (mean / median (steps), per step kind) and phase + traffic table.

    An update step is one that ends a CPU-update interval (StepStats.boundary); every other step
    is an accumulation step. `off` has no CPU updates, zero-offload has nothing but. Stall is the
    share of step time the host spent waiting inside step() (PCIe copies, accumulation, the CPU
    worker); GPU busy is (forward + backward + device optimizer) / step time.
    """
    t = Table(
        title=f"Step time, ms: mean / median (steps) - {meta['timing']}, {meta['device']}\n{settings_line(meta)}",
        title_justify="left",
    )
    cols = ("#", "configuration", "accumulation steps", "update steps", "all steps", "speedup", "stall",
            "GPU busy")
    for col in cols:
        t.add_column(col, justify="left" if col == "configuration" else "right")
    for i, r in enumerate(rows, 1):
        s = r["step_ms"]
        t.add_row(
            str(i),
            r["label"],
            _mm(s["accumulate"]),
            _mm(s["update"]),
            _mm(s["overall"]),
            _x(r["speedup_vs_zero_offload"]),
            _pct(r["stall_fraction"]),
            _pct(r.get("gpu_busy_fraction")),
        )
    console.print(t)

    p = Table(
        title="Phases: mean ms per step (CPU step: per completed CPU update); PCIe bytes per step",
        title_justify="left",
    )
    for col in (
        "#",
        "forward",
        "backward",
        "optimizer",
        "device opt",
        "offload",
        "CPU step",
        "stall",
        "D2H",
        "H2D",
        "x model",
        "host B/param/U",
    ):
        p.add_column(col, justify="right")
    for i, r in enumerate(rows, 1):
        phases = [
            fmt_ms(r[f"{k}_ms"]["mean"])
            for k in ("fwd", "bwd", "opt", "device_opt", "offload", "cpu_step", "stall")
        ]
        p.add_row(
            str(i),
            *phases,
            fmt_bytes(r["d2h_bytes_per_step"]),
            fmt_bytes(r["h2d_bytes_per_step"]),
            _x(r["traffic_x_model"]),
            DASH if r.get("host_bytes_per_param_interval") is None else f"{r['host_bytes_per_param_interval']:.1f}",
        )
    console.print(p)
    print_bounds(console, rows, meta)
    console.print(f"note: {noise_note(rows, meta)}", style="yellow", highlight=False, soft_wrap=True)


GAP_COLUMNS = ("selection", "install", "boundary wait", "hook wait", "copy wait", "other")


def _rate(v: float | None) -> str:
    return "not measured" if v is None else f"{v:.1f} GB/s"


def print_bounds(console: Console, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """The bound each configuration's bytes set (zfctl/bench/bound.py), beside its measured mean
    step, their ratio, which resource sets it, and what the gap is made of (ms per step)."""
    t = Table(
        title=(f"Bound per step: {meta.get('bound_rule')}; D2H {_rate(meta.get('d2h_gbps'))}, H2D "
               f"{_rate(meta.get('h2d_gbps'))}, host memory {_rate(meta.get('host_gbps'))} "
               f"({meta.get('host_threads')} native threads); bytes from the engine's ledger"),
        title_justify="left",
    )
    for col in ("#", "measured", "bound", "x bound", "limit", "D2H", "H2D", "host", *GAP_COLUMNS):
        t.add_column(col, justify="left" if col == "limit" else "right")
    for i, r in enumerate(rows, 1):
        b = r.get("bound") or {}
        per, gap = b.get("bytes_per_step") or {}, b.get("gap_ms") or {}
        t.add_row(str(i), fmt_ms(b.get("measured_ms")), fmt_ms(b.get("bound_ms")), _x(b.get("ratio")),
                  str(b.get("limit") or DASH), *(fmt_bytes(per.get(k)) for k in ("d2h", "h2d", "host")),
                  *(_gap(gap.get(k)) for k in GAP_COLUMNS))
    console.print(t)


def _gap(v: float | None) -> str:
    return DASH if v is None else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


CSV_COLUMNS = [
    "name",
    "label",
    "topk",
    "interval",
    "overlap",
    "pin",
    "recompute",
    "steps",
    "trials",
    "n_accumulate",
    "n_update",
    "accumulate_mean_ms",
    "accumulate_median_ms",
    "update_mean_ms",
    "update_median_ms",
    "overall_mean_ms",
    "overall_median_ms",
    "fwd_mean_ms",
    "bwd_mean_ms",
    "opt_mean_ms",
    "device_opt_mean_ms",
    "offload_mean_ms",
    "cpu_step_mean_ms",
    "n_cpu_steps",
    "stall_mean_ms",
    "stall_fraction",
    "gpu_busy_fraction",
    "host_bytes_per_param_interval",
    "d2h_bytes_per_step",
    "h2d_bytes_per_step",
    "comm_bytes_per_step",
    "traffic_x_model",
    "host_bytes_per_step",
    "bound_ms",
    "bound_ratio",
    "bound_limit",
    "speedup_vs_zero_offload",
    "wall_ms_per_step",
    "samples_per_s",
    "tokens_per_s",
    "peak_host_rss_bytes",
    "peak_device_allocated_bytes",
    "peak_device_reserved_bytes",
]


def csv_row(r: dict[str, Any]) -> dict[str, Any]:
    out = {k: r[k] for k in CSV_COLUMNS if k in r}
    for kind in ("accumulate", "update", "overall"):
        out[f"{kind}_mean_ms"] = r["step_ms"][kind]["mean"]
        out[f"{kind}_median_ms"] = r["step_ms"][kind]["median"]
    for key in ("fwd", "bwd", "opt", "device_opt", "offload", "cpu_step", "stall"):
        out[f"{key}_mean_ms"] = r[f"{key}_ms"]["mean"]
    out["n_cpu_steps"] = r["cpu_step_ms"]["n"]
    b = r.get("bound") or {}
    out["bound_ms"], out["bound_ratio"], out["bound_limit"] = b.get("bound_ms"), b.get("ratio"), b.get("limit")
    return {k: ("" if out.get(k) is None else out[k]) for k in CSV_COLUMNS}


def render_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(csv_row(r))
    return buf.getvalue()


def render_json(meta: dict[str, Any], rows: list[dict[str, Any]], skipped: list[dict[str, str]]) -> str:
    return json.dumps({"meta": meta, "results": rows, "skipped": skipped}, indent=2) + "\n"


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write to a temporary file in the same folder, then rename over `path` (atomic on POSIX)."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or Path("."))
    # mkstemp creates 0600; the report is for sharing, so it gets the mode any new file gets
    # (0666 less the umask), as zfctl/plan/io.py's atomic_write_text does.
    os.fchmod(fd, 0o666 & ~current_umask())
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
