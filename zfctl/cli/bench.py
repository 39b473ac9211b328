"""`zfctl bench`: time ZenFlow configurations against plain CPU offload, phase by phase.

Thin: declares the flags and checks them (zfctl/cli/_bench_flags.py: every mistake is one line
naming the flag, exit 2, before anything runs), then hands a `BenchOptions` to `zfctl.bench.suite.run_bench` and writes the
report files.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from zfctl.cli._bench_flags import (
    BENCH_PRESET,
    _at_least,
    _check_grid,
    _check_out,
    _model_config,
    _recomputes,
    _zenflow_config,
)
from zfctl.cli._common import VerboseOpt
from zfctl.errors import UserError

SYNTH = "Synthetic model (default: the reference benchmark's shape)"
PRESET = "Preset model (--model)"
GRID = "Grid (each takes a comma list)"
RUN = "Run length and settings"
OUT = "Output"


def _bench_selection(selection: bool, model: str, stay: float | None, topk: str, json_out: Path | None,
                    force: bool) -> None:
    """``--selection``: one synthetic selection's costs (zfctl/bench/selection.py), printed and as JSON."""
    from zfctl.bench.grid import parse_topks

    if not selection:
        raise UserError("--stay applies to --selection; add --selection, or drop --stay")
    stay = 0.1 if stay is None else stay
    if not 0 < stay <= 1:  # also refuses nan
        raise UserError(f"--stay {stay}: must be in (0, 1], the share of device columns that stay, e.g. 0.1")
    topks = parse_topks(topk)
    if len(topks) != 1 or not 0 < topks[0] < 1:
        raise UserError(f"--topk {topk}: --selection takes one ratio in (0, 1), e.g. 0.1")
    model_cfg = _model_config(model)  # an unknown preset: one error line
    _check_out("--json", json_out, force)
    import json

    from zfctl.bench.report import write_atomic
    from zfctl.bench.selection import run_selection
    from zfctl.cli._common import console

    r = run_selection(model_cfg, stay, topk=topks[0])
    console.print(f"selection at {model}'s shapes: {r['matrices']} matrices, {r['selected_cols']:,} of "
                  f"{r['host_cols']:,} columns selected, {stay:.0%} staying ({r['entering_cols']:,} entering), "
                  "one torch thread, CPU")
    for name, ms in r["phases"].items():
        console.print(f"  {name:<18} {ms:9.1f} ms")
    b = r["bytes"]
    console.print(f"  main thread {r['main_thread_ms']:.1f} ms (priority wait excluded); priority runs "
                  f"{r['priority_runs_ms']:.1f} ms (AdamW excluded), {r['priority_cuts']} run cut; worker fill "
                  f"{r['fill_ms']:.1f} ms ({r['fill_gathers']} host gathers, inside the priority wait)")
    console.print(f"  {r['device_ops']} device ops ({r['device_ops_main']} main thread, {r['device_ops_fill']} fill) "
                  f"over {r['device_blocks']} device blocks; {r['main_thread_gathers']} main-thread gathers; "
                  f"D2H {b['d2h'] / 1e9:.2f} GB, H2D {b['h2d'] / 1e9:.2f} GB, host {b['host'] / 1e9:.2f} GB "
                  "(the move's, at full row widths)")
    if json_out is not None:
        write_atomic(json_out, json.dumps(r, indent=1) + "\n")
        console.print(f"wrote {json_out}")


def bench(
    model: Annotated[
        str | None,
        typer.Option(
            help="Benchmark a model preset's architecture with random weights instead of the synthetic "
            "MLP, e.g. tiny-llama or llama3.2-1b (hub presets: a Llama of the preset's sizes).",
            rich_help_panel=PRESET,
        ),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(help="Tokens per sequence for --model (default 256).", rich_help_panel=PRESET),
    ] = None,
    batch: Annotated[
        int | None, typer.Option(help="Sequences per step for --model (default 1).", rich_help_panel=PRESET)
    ] = None,
    hidden_dim: Annotated[
        int | None,
        typer.Option(help="Width of each Linear(hidden, hidden) (default 1024).", rich_help_panel=SYNTH),
    ] = None,
    nlayers: Annotated[
        int | None, typer.Option(help="Number of Linear layers (default 1).", rich_help_panel=SYNTH)
    ] = None,
    dtype: Annotated[str, typer.Option(help="Model dtype: bf16, fp16 or fp32.")] = "bf16",
    topk: Annotated[str, typer.Option(help="topk_ratio values, e.g. 0.1,0.2.", rich_help_panel=GRID)] = "0.1",
    interval: Annotated[
        str,
        typer.Option(help="update_interval values (integers >= 1 or auto), e.g. 2,4.", rich_help_panel=GRID),
    ] = "4",
    overlap: Annotated[
        str | None, typer.Option(help="overlap_step: on, off or on,off (default on).", rich_help_panel=GRID)
    ] = None,
    no_overlap: Annotated[
        bool, typer.Option("--no-overlap", help="Same as --overlap off.", rich_help_panel=GRID)
    ] = False,
    pin: Annotated[
        str | None,
        typer.Option(
            help="pin_memory: on, off or on,off (default on). No effect without CUDA.", rich_help_panel=GRID
        ),
    ] = None,
    no_pin: Annotated[
        bool, typer.Option("--no-pin", help="Same as --pin off.", rich_help_panel=GRID)
    ] = False,
    activation_checkpointing: Annotated[
        str | None,
        typer.Option(
            help="Recompute each decoder layer in the backward (train.activation_checkpointing): on, off or "
            "on,off to compare (default off; --model only).",
            rich_help_panel=GRID,
        ),
    ] = None,
    grad_layout: Annotated[
        str | None,
        typer.Option(
            "--grad-layout",
            help="zenflow.tuning.grad_layout of the ZenFlow points: slots, carry or slots,carry to compare "
            "(the host gradient layout: per-step slots, or one fp32 sum; the table's host B/param/U and the "
            "bound say what each moves). Default: the preset's.",
            rich_help_panel=GRID,
        ),
    ] = None,
    warmup: Annotated[
        int, typer.Option(help="Untimed steps first (rounded up to whole intervals).", rich_help_panel=RUN)
    ] = 4,
    iterations: Annotated[
        int,
        typer.Option(
            help="Timed length in intervals of the longest --interval: every configuration times about "
            "iterations x max(interval) steps, a whole number of its own intervals.",
            rich_help_panel=RUN,
        ),
    ] = 5,
    trials: Annotated[
        int,
        typer.Option(
            help="Runs per configuration, each on a fresh model; their steps are pooled.", rich_help_panel=RUN
        ),
    ] = 1,
    zenflow: Annotated[
        str | None,
        typer.Option(
            help="ZenFlow preset (e.g. default, paper) whose other zenflow.* keys (selection, "
            "deferred_lr_scale, ...) every configuration starts from; --topk/--interval/--overlap/--pin "
            "still set those four. Default: paper, the reference benchmark's algorithm (zfctl finetune's "
            "default is the default preset).",
            rich_help_panel=GRID,
        ),
    ] = None,
    baselines: Annotated[
        str,
        typer.Option(
            help="Which baselines run beside the grid: off,zero-offload, off, zero-offload or none (runs "
            "of one shape that differ only in --zenflow/--accumulate need them once).",
            rich_help_panel=GRID,
        ),
    ] = "off,zero-offload",
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            "-s",
            metavar="KEY=VALUE",
            help="Override one zenflow.* key for every configuration, on top of --zenflow, e.g. --set "
            "zenflow.tuning.install_lag=1 (repeatable; YAML values; the grid's own keys have their flags).",
            rich_help_panel=GRID,
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cuda or cpu.", rich_help_panel=RUN)] = "auto",
    seed: Annotated[int, typer.Option(help="Seed for weights and inputs.", rich_help_panel=RUN)] = 0,
    cpu_threads: Annotated[
        int, typer.Option(help="zenflow.cpu_threads for the CPU AdamW (0 = all cores).", rich_help_panel=RUN)
    ] = 0,
    accumulate: Annotated[
        str,
        typer.Option(help="zenflow.accumulate: auto, host or device (where gradients are summed).",
                     rich_help_panel=RUN),
    ] = "auto",
    max_grad_norm: Annotated[
        float | None,
        typer.Option(
            help="Clip gradients to this global norm (adds a norm pass per step); default: no "
            "clipping, like the reference.",
            rich_help_panel=RUN,
        ),
    ] = None,
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help="Write the report, with every timed step, as JSON.", rich_help_panel=OUT),
    ] = None,
    csv_out: Annotated[
        Path | None,
        typer.Option("--csv", help="Write one row per configuration as CSV.", rich_help_panel=OUT),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Draw step time and stall share into a PNG (needs matplotlib: pip install 'zfctl\\[plot]').",
            rich_help_panel=OUT,
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Overwrite existing --json/--csv/--plot files.", rich_help_panel=OUT),
    ] = False,
    selection: Annotated[
        bool,
        typer.Option(
            "--selection",
            help="Instead of training: time one selection's main-thread work on CPU at --model's real "
            "shapes (default llama3.2-1b), per phase, with its device ops, host gathers and bytes "
            "(zfctl/bench/selection.py). Takes --stay, --topk (one value) and --json.",
            rich_help_panel=RUN,
        ),
    ] = False,
    stay: Annotated[
        float | None,
        typer.Option(help="--selection: share of each matrix's device columns that stay, in (0, 1] "
                     "(default 0.1: nine in ten replaced).", rich_help_panel=RUN),
    ] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Measure ZenFlow against plain CPU offload (zero-offload) and no offload (off), per phase.

    Example: zfctl bench --topk 0.1,0.2 --interval 2,4 --overlap on,off --json bench.json
    One option against its default: zfctl bench --set zenflow.tuning.install_lag=1
    Activation checkpointing on and off: zfctl bench --model tiny-llama --activation-checkpointing on,off
    """
    from zfctl.quiet import set_verbose

    set_verbose(verbose)  # before transformers loads (--model): its bars read the environment once
    from zfctl.bench.grid import (
        build_grid,
        parse_baselines,
        parse_intervals,
        parse_layouts,
        parse_switch,
        parse_topks,
    )
    from zfctl.bench.model import DTYPES

    # Everything the user typed is checked here, before a model is built or a file is touched.
    if selection or stay is not None:
        if csv_out is not None or plot is not None:
            raise UserError("--csv/--plot draw a training grid; --selection writes --json only")
        _bench_selection(selection, model or "llama3.2-1b", stay, topk, json_out, force)
        return
    topks, intervals = parse_topks(topk), parse_intervals(interval)
    overlaps, pins = parse_switch("overlap", overlap, no_overlap), parse_switch("pin", pin, no_pin)
    recomputes = [False] if activation_checkpointing is None else _recomputes(activation_checkpointing)
    if any(recomputes) and model is None:
        raise UserError("--activation-checkpointing on needs --model PRESET: the synthetic MLP has no decoder layers")
    which_baselines = parse_baselines(baselines)
    layouts = parse_layouts(grad_layout)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if device not in ("auto", "cuda", "cpu"):
        raise UserError(f"--device {device!r}: use auto, cuda or cpu")
    for flag, v in (
        ("--seq-len", seq_len),
        ("--batch", batch),
        ("--hidden-dim", hidden_dim),
        ("--nlayers", nlayers),
        ("--iterations", iterations),
        ("--trials", trials),
    ):
        _at_least(flag, v)
    _at_least("--warmup", warmup, 0)
    _at_least("--cpu-threads", cpu_threads, 0)
    if max_grad_norm is not None and not 0 < max_grad_norm < math.inf:  # also refuses nan and inf
        raise UserError(f"--max-grad-norm {max_grad_norm}: must be a finite number > 0 (omit it for no clipping)")
    if model is None and (seq_len is not None or batch is not None):
        raise UserError(
            "--seq-len/--batch apply to --model PRESET; the synthetic model takes one sample "
            "of --hidden-dim values per step"
        )
    if model is not None and (hidden_dim is not None or nlayers is not None):
        raise UserError(
            f"--hidden-dim/--nlayers shape the synthetic model; drop them with --model {model} "
            "(the preset fixes the shapes)"
        )
    paths = [p.resolve() for p in (json_out, csv_out, plot) if p is not None]
    if len(set(paths)) != len(paths):
        raise UserError("--json, --csv and --plot must name different files")
    _check_out("--json", json_out, force)
    _check_out("--csv", csv_out, force)
    _check_out("--plot", plot, force, suffix=".png")
    if plot is not None:
        from zfctl.bench.plot import require_matplotlib

        require_matplotlib()
    model_cfg = _model_config(model) if model is not None else None
    renamed: list[str] = []
    zenflow_cfg = _zenflow_config(zenflow, set_ or [], renamed)
    _check_grid(build_grid(topks, intervals, overlaps, pins, with_off=True, layouts=layouts), zenflow_cfg)

    from zfctl.bench.report import print_tables, render_csv, render_json, write_atomic
    from zfctl.bench.suite import BenchOptions, run_bench
    from zfctl.cli._common import console, note_line

    for note in renamed:
        note_line(note)
    opts = BenchOptions(
        topks=topks,
        intervals=intervals,
        overlaps=overlaps,
        pins=pins,
        dtype=dtype,
        hidden_dim=hidden_dim or 1024,
        nlayers=nlayers or 1,
        model=model_cfg,
        seq_len=seq_len or 256,
        batch=batch or 1,
        warmup=warmup,
        iterations=iterations,
        trials=trials,
        device=device,
        seed=seed,
        cpu_threads=cpu_threads,
        max_grad_norm=max_grad_norm,
        zenflow=zenflow_cfg,
        accumulate=accumulate,
        baselines=which_baselines,
        recomputes=recomputes,
        layouts=layouts,
    )
    report = run_bench(opts, console)
    # What the rows start from, for the tables, the plot and the JSON (zfctl/bench/report.py).
    report.meta.update(zenflow_preset=zenflow or BENCH_PRESET, zenflow_set=list(set_ or []))
    print_tables(console, report.rows, report.meta)
    if json_out is not None:
        rows = [
            dict(row, records=[asdict(r) for r in res.records])
            for row, res in zip(report.rows, report.results, strict=True)
        ]
        write_atomic(json_out, render_json(report.meta, rows, report.skipped))
        console.print(f"wrote {json_out}")
    if csv_out is not None:
        write_atomic(csv_out, render_csv(report.rows))
        console.print(f"wrote {csv_out}")
    if plot is not None:
        from zfctl.bench.plot import plot as draw

        draw(report.rows, plot, report.meta)
        console.print(f"wrote {plot}")
