"""Run a whole benchmark grid: decide what fits, run every configuration, summarise.

This is what `zfctl bench` calls; it is also usable from Python:

    report = run_bench(BenchOptions(topks=[0.1], intervals=[2, 4]), console)
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, Literal, cast

import torch
from rich.console import Console

import zfctl
from zfctl.bench.bound import add_bounds, measure_machine
from zfctl.bench.grid import (
    BenchConfig,
    Interval,
    build_grid,
    measured_steps,
    reference_interval,
    warmup_steps,
)
from zfctl.bench.memory import check_host_fits, off_fits, read_peaks, reset_peaks
from zfctl.bench.model import BenchModel, PresetFactory, recomputing, synthetic_model
from zfctl.bench.report import fmt_ms
from zfctl.bench.runner import ConfigResult, release_memory, run_config
from zfctl.bench.summary import add_speedups, summarize
from zfctl.errors import UserError
from zfctl.offload.config import ZenFlowConfig
from zfctl.train.dist import resolve_device


@dataclass
class BenchOptions:
    """Everything `zfctl bench` was asked to do (already parsed and range-checked)."""

    topks: list[float] = field(default_factory=lambda: [0.1])
    intervals: list[Interval] = field(default_factory=lambda: [4])
    overlaps: list[bool] = field(default_factory=lambda: [True])
    pins: list[bool] = field(default_factory=lambda: [True])
    hidden_dim: int = 1024
    nlayers: int = 1
    dtype: str = "bf16"
    model: Any = None  # a zfctl.plan.schema.ModelConfig (source 'config') for --model, else None
    seq_len: int = 256
    batch: int = 1
    warmup: int = 4
    iterations: int = 5
    trials: int = 1
    device: str = "auto"
    seed: int = 0
    lr: float = 1e-5
    max_grad_norm: float | None = None
    cpu_threads: int = 0
    zenflow: ZenFlowConfig | None = None  # --zenflow PRESET: the non-grid zenflow.* keys
    accumulate: str = "auto"  # zenflow.accumulate for every ZenFlow configuration
    baselines: tuple[str, ...] = ("off", "zero-offload")  # which of the two baselines to run
    recomputes: list[bool] = field(default_factory=lambda: [False])  # activation checkpointing (--model only)
    layouts: list[Literal["slots", "carry"] | None] = field(default_factory=lambda: [None])  # zenflow.tuning.grad_layout (--grad-layout)


@dataclass
class BenchReport:
    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    skipped: list[dict[str, str]]
    results: list[ConfigResult]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} torch threads, {os.cpu_count()} cores)"


def _native_isa() -> str | None:
    try:
        from zfctl import _native

        return _native.isa()
    except (ImportError, UserError):  # not built yet: the engine will say so when it needs it
        return None


def run_bench(opts: BenchOptions, console: Console) -> BenchReport:
    """Run baselines + grid and return the summarised report (nothing is printed but progress)."""
    if opts.accumulate not in ("auto", "host", "device"):
        raise UserError(f"--accumulate {opts.accumulate!r}: use auto, host or device")
    device = resolve_device(
        opts.device, no_cuda="--device cuda: this torch build sees no CUDA device; use --device cpu or auto")

    if opts.model is not None:
        build: Callable[[int], BenchModel] = PresetFactory(
            opts.model,
            dtype=opts.dtype,
            device=device,
            seed=opts.seed,
            seq_len=opts.seq_len,
            batch=opts.batch,
        )
    else:
        build = partial(
            synthetic_model,
            hidden_dim=opts.hidden_dim,
            nlayers=opts.nlayers,
            dtype=opts.dtype,
            device=device,
            seed=opts.seed,
        )

    probe = build(1)
    n_params, param_bytes = probe.n_params, probe.param_bytes
    samples, tokens, desc = probe.samples_per_step, probe.tokens_per_step, probe.description
    check_host_fits(n_params)
    fits, why = off_fits(n_params, param_bytes, device)
    del probe
    release_memory(device)

    skipped: list[dict[str, str]] = []
    if not fits and "off" in opts.baselines:
        skipped.append({"label": "off (all on device)", "reason": why})
    if any(opts.recomputes) and opts.model is None:
        raise UserError("--activation-checkpointing on needs --model PRESET: the synthetic MLP has no decoder layers")
    configs = build_grid(opts.topks, opts.intervals, opts.overlaps, opts.pins,
                         with_off=fits and "off" in opts.baselines,
                         with_zero_offload="zero-offload" in opts.baselines, recomputes=opts.recomputes,
                         layouts=opts.layouts)
    ref = reference_interval(opts.intervals)
    # The machine, once: the link each way and the host memory rate at the run's native threads
    # (bound.py; a few pinned copies and one AdamW pass over 4x the last-level cache).
    machine = measure_machine(device, opts.cpu_threads)
    meta = {
        "zfctl": zfctl.__version__,
        "torch": torch.__version__,
        "device": _device_name(device),
        "timing": "CUDA events" if device.type == "cuda" else "wall clock",
        "model": desc,
        "n_params": n_params,
        "param_bytes": param_bytes,
        "dtype": opts.dtype,
        "warmup": opts.warmup,
        "iterations": opts.iterations,
        "reference_interval": ref,
        "trials": opts.trials,
        "seed": opts.seed,
        "native_isa": _native_isa(),
        # The pinned D2H rate the optimizer sizes its in-flight gradient bytes from, the H2D rate
        # (None off CUDA) and the native kernels' host memory rate: what the bound divides by.
        "d2h_gbps": machine.d2h_gbps,
        "h2d_gbps": machine.h2d_gbps,
        "host_gbps": machine.host_gbps,
        "host_threads": machine.host_threads,
        "bound_rule": ("compute + host memory (one set of cores), per step" if machine.same_cores
                       else "max(device compute, D2H, H2D, host memory), per step"),
        "cpu_threads": opts.cpu_threads,
        "zenflow_base": asdict(opts.zenflow) if opts.zenflow is not None else None,
        "accumulate": opts.accumulate,
        "baselines": list(opts.baselines),
        # peak_host_rss_bytes of each row: since that configuration started ("configuration") where
        # the kernel lets the process reset its VmHWM, else since the process started ("process").
        "host_rss_peak_scope": None,  # set once the grid has run
        "max_grad_norm": opts.max_grad_norm,
        "grid": {"topk": opts.topks, "interval": opts.intervals, "overlap": opts.overlaps, "pin": opts.pins,
                 "activation_checkpointing": opts.recomputes, "grad_layout": opts.layouts},
        "model_preset": getattr(opts.model, "name", None),
        "seq_len": opts.seq_len if opts.model is not None else None,
        "batch": opts.batch if opts.model is not None else None,
        "hidden_dim": opts.hidden_dim if opts.model is None else None,
        "nlayers": opts.nlayers if opts.model is None else None,
    }
    console.print(
        f"[bold]zfctl bench[/]: {desc}, {n_params / 1e6:.2f}M params on {meta['device']}; "
        f"{len(configs)} configurations x {opts.trials} trial(s), timing by {meta['timing']}"
        + (f"; D2H {meta['d2h_gbps']:.1f} GB/s" if meta["d2h_gbps"] else "")
        + (f", H2D {meta['h2d_gbps']:.1f} GB/s" if meta["h2d_gbps"] else "")
        + (f"; host memory {meta['host_gbps']:.1f} GB/s on {machine.host_threads} native threads"
           if meta["host_gbps"] else "")
    )
    for s in skipped:
        console.print(f"  skipping {s['label']}: {s['reason']}")
    if device.type != "cuda" and len(opts.pins) > 1:
        console.print("  note: pin_memory changes nothing without CUDA; pin on/off rows differ only by noise")

    accumulate = cast(Literal["auto", "host", "device"], opts.accumulate)  # checked at the top
    base = replace(opts.zenflow or ZenFlowConfig(), cpu_threads=opts.cpu_threads, accumulate=accumulate)
    opt_kwargs = {"lr": opts.lr, "weight_decay": 0.0, "max_grad_norm": opts.max_grad_norm}
    results, rows, scoped = [], [], True
    for i, cfg in enumerate(configs, 1):
        warm = warmup_steps(cfg.interval, opts.warmup)
        steps = measured_steps(cfg.interval, opts.iterations, ref)
        scoped = reset_peaks(device) and scoped
        res = run_config(
            cfg,
            recomputing(build) if cfg.recompute else build,
            base,
            warmup=warm,
            steps=steps,
            trials=opts.trials,
            device=device,
            opt_kwargs=opt_kwargs,
        )
        row = summarize(res, param_bytes=param_bytes, samples_per_step=samples, tokens_per_step=tokens,
                        n_params=n_params)
        row.update(read_peaks(device))  # the trials' peaks: each trial frees its model and optimizer
        results.append(res)
        rows.append(row)
        _progress(console, i, len(configs), cfg, row)
    add_speedups(rows)
    add_bounds(rows, results, machine)  # after the grid: every row's device compute from its `off` row
    meta["host_rss_peak_scope"] = "configuration" if scoped else "process"
    return BenchReport(meta, rows, skipped, results)


def _progress(console: Console, i: int, n: int, cfg: BenchConfig, row: dict[str, Any]) -> None:
    s = row["step_ms"]
    console.print(
        f"  [{i}/{n}] {cfg.label}: {fmt_ms(s['overall']['mean'])} ms/step "
        f"(accumulation {fmt_ms(s['accumulate']['mean'])}, update {fmt_ms(s['update']['mean'])}), "
        f"stall {100 * (row['stall_fraction'] or 0):.1f}%, GPU busy {100 * (row['gpu_busy_fraction'] or 0):.1f}%"
        + (f", {row['n_skipped']} fp16 overflow steps skipped" if row["n_skipped"] else "")
    )
