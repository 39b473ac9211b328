"""From timed steps to the numbers in the report.

The rule that the reference's table breaks: every quantity is averaged ONLY over the steps that
have it. Accumulation-step time is averaged over accumulation steps, update-step time over update
steps, CPU-step time over the steps in which a CPU update completed. A quantity no step has is
None (shown as '-'), never 0: the reference fills missing timer keys with zeros, which turns its
"avg_step" into (sum of boundary times) / (all lines), a number that is no step's time.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from zfctl.bench.runner import ConfigResult, StepRecord


@dataclass
class Agg:
    """Mean and median over the `n` steps that have the quantity (None when n == 0)."""

    mean: float | None
    median: float | None
    n: int


def agg(values: Iterable[float]) -> Agg:
    vals = list(values)
    if not vals:
        return Agg(None, None, 0)
    return Agg(statistics.fmean(vals), statistics.median(vals), len(vals))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(
    res: ConfigResult, *, param_bytes: int, samples_per_step: int, tokens_per_step: int,
    n_params: int | None = None,
) -> dict[str, Any]:
    """One configuration's report row (JSON-ready). Speedup is filled by `add_speedups`."""
    recs: list[StepRecord] = res.records
    # A skipped fp16 step (overflow: no update at all) is neither kind; it stays in "overall",
    # since the time was spent, and is counted in n_skipped.
    acc = [r for r in recs if not r.update and not r.skipped]
    upd = [r for r in recs if r.update and not r.skipped]
    cpu = [r.cpu_step_ms for r in recs if r.cpu_step_ms > 0]  # steps where a CPU update completed
    overall = agg(r.step_ms for r in recs)
    total_ms = sum(r.step_ms for r in recs)
    d2h = agg(r.d2h_bytes for r in recs)
    h2d = agg(r.h2d_bytes for r in recs)
    cfg = res.config
    row: dict[str, Any] = {
        "name": cfg.name,
        "label": cfg.label,
        "topk": cfg.topk,
        "interval": cfg.interval,
        "overlap": cfg.overlap,
        "pin": cfg.pin,
        "recompute": cfg.recompute,
        "warmup_steps": res.warmup_steps,
        "steps": res.steps,
        "trials": len(res.trials),
        "n_accumulate": len(acc),
        "n_update": len(upd),
        "n_skipped": sum(r.skipped for r in recs),
        "step_ms": {
            "accumulate": asdict(agg(r.step_ms for r in acc)),
            "update": asdict(agg(r.step_ms for r in upd)),
            "overall": asdict(overall),
        },
        "fwd_ms": asdict(agg(r.fwd_ms for r in recs)),
        "bwd_ms": asdict(agg(r.bwd_ms for r in recs)),
        "opt_ms": asdict(agg(r.opt_ms for r in recs)),
        "device_opt_ms": asdict(agg(r.device_opt_ms for r in recs)),
        "offload_ms": asdict(agg(r.offload_ms for r in recs)),
        "cpu_step_ms": asdict(agg(cpu)),
        "stall_ms": asdict(agg(r.stall_ms for r in recs)),
        "stall_update_ms": asdict(agg(r.stall_ms for r in upd)),
        "stall_fraction": sum(r.stall_ms for r in recs) / total_ms if total_ms > 0 else None,
        # GPU busy = (forward + backward + device optimizer) / step: what is left is the device
        # waiting on the host or on PCIe (stall) and launch gaps.
        "gpu_busy_fraction": min(1.0, sum(r.busy_ms for r in recs) / total_ms) if total_ms > 0 else None,
        "host_bytes_per_step": agg(r.host_bytes for r in recs).mean,
        # Host memory traffic of one interval (the ledger's host.* bytes: landing, summing, the CPU
        # update, the install, a migration in the window), per model parameter: the number the
        # "less host work" choices move (docs/design.md, "Performance model").
        "host_bytes_per_param_interval": (
            sum(r.host_bytes for r in recs) / len(upd) / n_params if n_params and upd else None
        ),
        "d2h_bytes_per_step": d2h.mean,
        "h2d_bytes_per_step": h2d.mean,
        # Data-parallel bytes sent per step (StepStats.comm_bytes): 0 in this one-process bench;
        # the field keeps rows comparable with a --nproc run's metrics.jsonl.
        "comm_bytes_per_step": agg(r.comm_bytes for r in recs).mean,
        "traffic_x_model": _ratio((d2h.mean or 0) + (h2d.mean or 0), param_bytes),
        "wall_ms_per_step": statistics.fmean(t.window_wall_ms / len(t.records) for t in res.trials),
        "trial_overall_ms": [statistics.fmean(r.step_ms for r in t.records) for t in res.trials],
        "samples_per_s": _ratio(1e3 * samples_per_step, overall.mean),
        "tokens_per_s": _ratio(1e3 * tokens_per_step, overall.mean),
        "loss_first": res.trials[0].loss_first,
        "loss_last": res.trials[0].loss_last,
        "speedup_vs_zero_offload": None,
    }
    return row


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """speedup = zero-offload's overall mean step ms / this row's, against the zero-offload run
    with the same pin and recompute settings (pinning changes the baseline's own copies, recompute
    its forward), else any zero-offload."""
    def key(r: dict[str, Any]) -> tuple[bool, bool]:
        return r["pin"], bool(r.get("recompute"))

    base = {key(r): r["step_ms"]["overall"]["mean"] for r in rows if r["name"] == "zero-offload"}
    fallback = next(iter(base.values()), None)
    for r in rows:
        r["speedup_vs_zero_offload"] = _ratio(base.get(key(r), fallback), r["step_ms"]["overall"]["mean"])
