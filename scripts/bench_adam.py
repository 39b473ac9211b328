"""Time the native CPU AdamW against torch and DeepSpeed on one machine, with a bandwidth yardstick.

    .venv/bin/python scripts/bench_adam.py                 # 100M params, 1 and all threads
    .venv/bin/python scripts/bench_adam.py --params 20e6 --json out.json
    .venv/bin/python scripts/bench_adam.py --busy 2        # with 2 CPU-spinning processes alongside

Workloads (per step, 100M params by default):
  (a) plain fp32 AdamW: params, grads and both moments fp32. Counted bytes: 28 B/param (read
      p, g, m, v; write p, m, v), the minimum any implementation must move.
  (b) the offload step: bf16 gradient in, fp32 master + moments updated, bf16 copy of the new
      params out. Counted: 28 B/param (read p, m, v, g16; write p, m, v, out16). zfctl does this in
      one pass; torch (and DeepSpeed) need cast -> fp32 step -> copy, 40 B/param actually moved.
"GB/s" is counted bytes / time (useful bandwidth; write-allocate traffic not counted, as in
STREAM), "% probe" compares it with the in-place read-modify-write probe (a += s*b, 12 B/elem) at
the same thread count. Rows with "tensors" > 1 split the same 100M params into a model-like list.

DeepSpeed's DeepSpeedCPUAdam runs in a subprocess of a Python where it is importable: this one,
--deepspeed-python, or /tmp/dsvenv/bin/python. It is never a zfctl dependency. A throw-away venv
that reuses this venv's torch (no multi-GB CUDA torch download; DeepSpeed JIT-builds its op once):
    python3 -m venv /tmp/dsvenv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/dsvenv/lib/python3.11/site-packages/torch.pth
    /tmp/dsvenv/bin/pip install --no-deps deepspeed hjson py-cpuinfo einops msgpack ninja pydantic packaging psutil
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
DS_VENV = Path("/tmp/dsvenv/bin/python")
COUNTED_BYTES = 28  # per param, both workloads (see the module docstring)


def row(workload: str, impl: str, threads: int, tensors: int, ms: float, **extra) -> dict:
    """One result line of the table."""
    return {"workload": workload, "impl": impl, "threads": threads, "tensors": tensors, "ms": ms, **extra}


def timed(fn, steps: int, warmup: int) -> float:
    """Median wall ms of fn() over `steps` calls after `warmup` calls (page faults, lazy state)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    time.sleep(0.05)  # let torch's OpenMP workers stop spinning before the next measurement
    return statistics.median(samples)


def split(t: torch.Tensor, tensors: int) -> list[torch.Tensor]:
    """Views of t as `tensors` near-equal pieces (a model's parameter list)."""
    return [c for c in t.chunk(tensors)]


def torch_optimizer(params: list[torch.Tensor], grads: list[torch.Tensor], impl: str) -> torch.optim.Optimizer:
    leaves = []
    for p, g in zip(params, grads):
        leaf = torch.nn.Parameter(p, requires_grad=True)  # shares p's memory
        leaf.grad = g
        leaves.append(leaf)
    if impl == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(leaves, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"])
    return torch.optim.AdamW(leaves, **HP, **{impl: True})


def bench_torch_like(impl: str, n: int, threads: int, tensors: int, steps: int, warmup: int) -> list[dict]:
    """Workload (a) and the multi-pass (b) for torch foreach/fused or DeepSpeed."""
    torch.set_num_threads(threads)
    p, g = torch.randn(n), torch.randn(n) * 1e-2
    opt = torch_optimizer(split(p, tensors), split(g, tensors), impl)
    rows = [row(workload="a", impl=impl, threads=threads, tensors=tensors, ms=timed(opt.step, steps, warmup))]
    if tensors == 1 and impl != "foreach":
        g16, out = g.to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)

        def multi_pass():
            g.copy_(g16)  # widen the bf16 gradient into the fp32 .grad
            opt.step()
            out.copy_(p)  # round the new params to bf16 for the upload

        rows.append(row(workload="b", impl=f"{impl} (3 passes)", threads=threads, tensors=1, ms=timed(multi_pass, steps, warmup)))
    return rows


def bench_native(n: int, threads: int, tensors: int, steps: int, warmup: int) -> list[dict]:
    from zfctl import _native as N

    N.set_num_threads(threads)
    torch.set_num_threads(threads)
    p, g, m, v = torch.randn(n), torch.randn(n) * 1e-2, torch.zeros(n), torch.zeros(n)
    step = [0]

    def one(**kw):
        step[0] += 1
        N.adamw_step(p, kw.pop("grad", g), m, v, step=step[0], lr=HP["lr"], beta1=HP["betas"][0],
                     beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"], **kw)

    rows = [row(workload="a", impl=f"zfctl ({N.isa()})", threads=threads, tensors=1, ms=timed(one, steps, warmup))]
    if tensors > 1:
        # The per-tensor calling pattern, to show what a call costs: `tensors` calls per step.
        views = [(split(t, tensors)) for t in (p, g, m, v)]

        def per_tensor():
            step[0] += 1
            for pp, gg, mm, vv in zip(*views):
                N.adamw_step(pp, gg, mm, vv, step=step[0], lr=HP["lr"], beta1=HP["betas"][0],
                             beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"])

        rows.append(row(workload="a", impl="zfctl, one call per tensor", threads=threads, tensors=tensors,
                         ms=timed(per_tensor, steps, warmup)))
        # ZenFlow's real call: one call over the 90% of columns the CPU owns, as a run list.
        # 4096-row column-major weights, every 10th column excluded (the GPU's top-k).
        cols = torch.arange(n // 4096)
        keep = cols[cols % 10 != 0]
        runs = torch.stack([keep * 4096, torch.full_like(keep, 4096)], 1)
        rows.append(row(workload="a", impl=f"zfctl, 90% in {len(keep)} runs", threads=threads, tensors=1,
                         ms=timed(lambda: one(runs=runs), steps, warmup), fraction=len(keep) * 4096 / n))
    g16, out = g.to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    rows.append(row(workload="b", impl="zfctl (1 pass)", threads=threads, tensors=1,
                     ms=timed(lambda: one(grad=g16, out=out), steps, warmup)))
    return rows


def best_ms(fn, steps: int) -> float:
    """Fastest of `steps` calls after one warm-up: STREAM's convention for a bandwidth ceiling."""
    fn()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return min(samples)


def probe(n: int, threads: int, steps: int) -> dict[str, float]:
    """STREAM-style bandwidth in GB/s with torch's vectorised elementwise loops (STREAM's byte
    counting: copy 8 B/elem, triad and in-place a += s*b 12 B/elem; write-allocate not counted).
    Best of `steps`, while the kernels report their median: the percentages err on the low side."""
    torch.set_num_threads(threads)
    a, b, c = torch.randn(n), torch.randn(n), torch.randn(n)
    ms = {
        "copy": best_ms(lambda: a.copy_(b), steps),
        "triad": best_ms(lambda: torch.add(b, c, alpha=0.5, out=a), steps),
        "rmw": best_ms(lambda: a.add_(b, alpha=1e-6), steps),
    }
    per = {"copy": 8, "triad": 12, "rmw": 12}
    return {k: per[k] * n / (ms[k] * 1e-3) / 1e9 for k in ms}


def deepspeed_rows(python: str | None, args) -> tuple[list[dict], str]:
    """Run the DeepSpeed measurements in a Python that has it; ([], reason) when there is none."""
    candidates = [python] if python else [sys.executable] + ([str(DS_VENV)] if DS_VENV.exists() else [])
    for exe in candidates:
        try:
            probe_ok = subprocess.run([exe, "-c", "import deepspeed.ops.adam"], check=False, capture_output=True)
        except OSError:  # no such python
            continue
        if probe_ok.returncode == 0:
            cmd = [exe, __file__, "--deepspeed-worker", "--params", str(args.params), "--steps", str(args.steps),
                   "--threads", args.threads, "--tensors", str(args.tensors)]
            done = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if done.returncode != 0:
                return [], f"DeepSpeed run failed: {done.stderr.strip().splitlines()[-1:]}"
            return json.loads(done.stdout.strip().splitlines()[-1]), f"DeepSpeed from {exe}"
    return [], f"DeepSpeed: not importable from {', '.join(candidates)} (see this script's docstring); skipped"


def _spin() -> None:
    while True:
        pass


def start_hogs(count: int) -> list[multiprocessing.Process]:
    """`count` processes that each keep one core busy: the training loop and other tenants."""
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for h in hogs:
        h.start()
    return hogs


def thread_counts(spec: str) -> list[int]:
    allc = len(os.sched_getaffinity(0))
    return sorted({allc if s == "all" else int(s) for s in spec.split(",")})


def table(rows: list[dict], probes: dict[int, dict[str, float]]) -> str:
    lines = ["| workload | implementation | threads | tensors | ms/step | Gparams/s | GB/s | % probe rmw |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        n = r["params"] * r.get("fraction", 1.0)
        gbs = COUNTED_BYTES * n / (r["ms"] * 1e-3) / 1e9
        pct = 100 * gbs / probes[r["threads"]]["rmw"]
        lines.append(f"| ({r['workload']}) | {r['impl']} | {r['threads']} | {r['tensors']} | {r['ms']:.1f} | "
                     f"{n / (r['ms'] * 1e-3) / 1e9:.2f} | {gbs:.1f} | {pct:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6, help="parameters per step (default 100M)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (median reported)")
    ap.add_argument("--threads", default="1,all", help="comma list of thread counts; 'all' = CPUs available")
    ap.add_argument("--tensors", type=int, default=400, help="also time a model-like list of this many tensors")
    ap.add_argument("--deepspeed-python", default=None, help="a python with deepspeed importable")
    ap.add_argument("--busy", type=int, default=0, help="run this many CPU-spinning processes meanwhile")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed rows")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--deepspeed-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = int(args.params)

    if args.deepspeed_worker:  # child: DeepSpeed rows as one JSON line
        rows = []
        for t in thread_counts(args.threads):
            rows += bench_torch_like("deepspeed", n, t, 1, args.steps, 1)
            if args.tensors > 1:
                rows += bench_torch_like("deepspeed", n, t, args.tensors, args.steps, 1)
        print(json.dumps(rows))
        return

    from zfctl import _native as N

    load0 = os.getloadavg()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
    print(f"# {cpu}; {len(os.sched_getaffinity(0))} CPUs; zfctl path {N.isa()}; torch {torch.__version__}; "
          f"{n / 1e6:.0f}M params; median of {args.steps} steps; load average {load0[0]:.2f}"
          + (f"; {args.busy} busy-spinning processes alongside" if args.busy else ""))
    hogs = start_hogs(args.busy)
    ds, ds_note = ([], "DeepSpeed: skipped (--no-deepspeed)") if args.no_deepspeed else deepspeed_rows(
        args.deepspeed_python, args
    )
    rows, probes = [], {}
    for t in thread_counts(args.threads):
        probes[t] = probe(n, t, args.steps)
        rows += bench_native(n, t, args.tensors, args.steps, 1)
        for impl in ("foreach", "fused"):
            rows += bench_torch_like(impl, n, t, 1, args.steps, 1)
            if args.tensors > 1 and impl == "fused":
                rows += bench_torch_like(impl, n, t, args.tensors, args.steps, 1)
    for h in hogs:
        h.terminate()
    rows += ds
    for r in rows:
        r["params"] = n
    rows.sort(key=lambda r: (r["workload"], r["threads"]))
    print(f"# {ds_note}")
    for t, pr in probes.items():
        print(f"# probe, {t} thread(s): copy {pr['copy']:.1f} GB/s, triad {pr['triad']:.1f} GB/s, "
              f"in-place rmw {pr['rmw']:.1f} GB/s")
    print(f"# counted bytes: {COUNTED_BYTES} B/param for (a) and (b); load average after: {os.getloadavg()[0]:.2f}")
    print(table(rows, probes))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "probes": probes, "load": [load0, os.getloadavg()]}, indent=1))


if __name__ == "__main__":
    main()
