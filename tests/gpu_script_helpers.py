"""Import scripts/gpu_*.py (scripts/ is not a package) and fake `zfctl bench --json` files for them.

The fake files are made by the bench's own summary and report code, so a renamed bench key
breaks these tests instead of passing them against a stale copy of the format.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

from zfctl.bench.bound import Machine, add_bounds
from zfctl.bench.grid import BenchConfig
from zfctl.bench.report import render_json
from zfctl.bench.runner import ConfigResult, StepRecord, TrialResult
from zfctl.bench.summary import add_speedups, summarize

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

# scripts/ had to be on sys.path first
import gpu_check
import gpu_common
import gpu_results

__all__ = ["REPO", "SCRIPTS", "bench_file", "gpu_check", "gpu_common", "gpu_results", "script"]


def script(name: str) -> ModuleType:
    """scripts/<name>.py as a module."""
    return importlib.import_module(name)

CONFIGS = {
    "off": BenchConfig("off", 1.0, 1, False, True),
    "zero-offload": BenchConfig("zero-offload", 0.0, 1, False, True),
    "zenflow": BenchConfig("zenflow", 0.1, 4, True, True),
}


# The rates the fake bench files say they measured (GB/s), as `zfctl bench` writes them in its meta.
RATES = {"d2h_gbps": 54.9, "h2d_gbps": 50.0, "host_gbps": 100.0}


def _records(name: str, step_ms: list[float], cpu_ms: float, host_bytes: int,
             selections: tuple[int, ...] = ()) -> list[StepRecord]:
    """Steps of `step_ms`; ZenFlow's every 4th is an update step whose CPU update took `cpu_ms`,
    and the steps at `selections` select (ZenFlow only); each offloading step's ledger: 500 MB of
    gradient D2H and `host_bytes` of host memory."""
    out = []
    for i, ms in enumerate(step_ms):
        update = name == "zero-offload" or (name == "zenflow" and i % 4 == 3)
        ledger = {} if name == "off" else {"d2h.grad": 500_000_000, "host.sum": host_bytes}
        out.append(StepRecord(update=update, step_ms=ms, fwd_ms=ms / 4, bwd_ms=ms / 2, opt_ms=ms / 4,
                              device_opt_ms=2.0, offload_ms=1.0, cpu_step_ms=cpu_ms if update else 0.0,
                              stall_ms=ms / 10, d2h_bytes=0 if name == "off" else 500_000_000, h2d_bytes=0,
                              skipped=False, host_bytes=host_bytes if name != "off" else 0, bytes=ledger,
                              selection=name == "zenflow" and i in selections))
    return out


def bench_file(folder: Path, batch: int, preset: str, rows: dict[str, list[float]], *, cpu_ms: float = 300.0,
               accumulate: str = "host", host_bytes: int = 1_000_000_000, selections: tuple[int, ...] = (),
               **meta_over) -> Path:
    """llama-1b-b<batch>-<preset>.json with one row per entry of `rows` ('off', 'zero-offload',
    'zenflow' -> its step times), as `zfctl bench --model llama3.2-1b --seq-len 1024 --json` writes it
    on CUDA, with each row's bound (zfctl/bench/bound.py, on ``RATES``): the device compute of `off`
    (3/4 of its step) + 2 ms, or ``host_bytes`` at 100 GB/s where that is slower. `meta_over`
    changes the meta (a wrong shape, CPU timing)."""
    out_rows, results = [], []
    for name, steps in rows.items():
        res = ConfigResult(CONFIGS[name], warmup_steps=8, steps=len(steps))
        res.trials.append(TrialResult(_records(name, steps, cpu_ms, host_bytes, selections), window_wall_ms=sum(steps),
                                      loss_first=12.0, loss_last=11.5))
        results.append(res)
        row = summarize(res, param_bytes=2_471_000_000, samples_per_step=batch, tokens_per_step=batch * 1024,
                        n_params=1_235_814_400)
        row.update(peak_host_rss_bytes=30 * 2**30, peak_device_allocated_bytes=9 * 2**30,
                   peak_device_reserved_bytes=10 * 2**30,
                   records=[asdict(r) for r in res.records])  # every timed step, as zfctl/cli/bench.py writes it
        out_rows.append(row)
    add_speedups(out_rows)
    meta = {"model_preset": "llama3.2-1b", "batch": batch, "seq_len": 1024, "dtype": "bf16",
            "timing": "CUDA events", "device": "NVIDIA H100 80GB HBM3", **RATES, "accumulate": accumulate,
            **meta_over}
    add_bounds(out_rows, results, Machine(meta["d2h_gbps"], meta["h2d_gbps"], meta["host_gbps"], 16, same_cores=False))
    path = folder / f"llama-1b-b{batch}-{preset}.json"
    path.write_text(render_json(meta, out_rows, []))
    return path
