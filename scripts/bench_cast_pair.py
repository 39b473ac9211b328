"""Time a release step's gradient pair on the host (departure.py ``gather_cast`` / ``scatter_cast``)
against the two-step form it replaced (``index_select`` to a temporary then ``copy_``; ``.to(bf16)``
then ``index_copy_``), at llama3.2-1b's selection: 45,513 columns of 2048 rows move each way.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_cast_pair.py   # ~1.1 GB of host memory

Each time is the fastest of --repeats; "largest alloc" is the biggest single host allocation the
profiler sees during one call (the reference's full-size temporary, or the bounded scratch).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from zfctl.offload.columns.departure import gather_cast, scatter_cast


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def largest_alloc_mb(fn: Callable[[], object]) -> float:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cols", type=int, default=45_513, help="columns moved each way")
    ap.add_argument("--width", type=int, default=2048, help="rows per column")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    host = torch.randn(2 * a.cols, a.width).to(torch.bfloat16)  # the step's slot, model dtype
    cols = torch.randperm(2 * a.cols)[: a.cols]
    ring, rows = torch.empty(a.cols, a.width), torch.randn(a.cols, a.width)  # fp32 in ring / out buffer
    cases = {
        "widen": (lambda: ring.copy_(host.index_select(0, cols)), lambda: gather_cast(host, cols, ring)),
        "narrow": (lambda: host.index_copy_(0, cols, rows.to(torch.bfloat16)), lambda: scatter_cast(host, cols, rows)),
    }
    print(f"torch threads {torch.get_num_threads()}, {a.cols:,} x {a.width} moved each way")
    for name, (ref, new) in cases.items():
        print(f"{name:6s} two-step {best_ms(ref, a.repeats):7.1f} ms ({largest_alloc_mb(ref):6.1f} MB largest alloc)"
              f"   fused {best_ms(new, a.repeats):7.1f} ms ({largest_alloc_mb(new):6.2f} MB)")


if __name__ == "__main__":
    main()
