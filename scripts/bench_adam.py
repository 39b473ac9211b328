"""Time the native CPU AdamW against torch and DeepSpeed on one machine, with a bandwidth yardstick.

    .venv/bin/python scripts/bench_adam.py                 # 100M params, 1 and all threads
    .venv/bin/python scripts/bench_adam.py --params 20e6 --json out.json
    .venv/bin/python scripts/bench_adam.py --busy 2        # with 2 CPU-spinning processes alongside
    .venv/bin/python scripts/bench_adam.py --compare       # zfctl vs torch fused, 24M fp32, 1 and 2 threads

--compare: the native AdamW against torch.optim.AdamW(fused=True) on the same thread count, plain
fp32 (workload (a) below), 24M params by default. The two alternate step by step (which one goes
first alternates too), so that load from other jobs on a shared machine hits both alike; a row
gives each one's min and median over --repeats steps, the ratios torch / zfctl of both (> 1: zfctl
is faster) and the median of the per-pair ratios (the most robust of the three under drifting load).

Every case runs in each of --rounds rounds (cases interleaved, so that load from other jobs on a
shared machine hits all of them alike); a row reports the median and the best of all its steps.

Workloads (per step, 100M params by default):
  (a) plain fp32 AdamW: params, grads and both moments fp32. Counted bytes: 28 B/param (read
      p, g, m, v; write p, m, v), the minimum any implementation must move.
  (b) the offload step: bf16 gradient in, fp32 master + moments updated, bf16 copy of the new
      params out. Counted: 28 B/param (read p, m, v, g16; write p, m, v, out16). zfctl does this in
      one pass; torch (and DeepSpeed) need cast -> fp32 step -> copy, 40 B/param actually moved.
"GB/s" is counted bytes / time (useful bandwidth; write-allocate traffic not counted, as in
STREAM). The probe is plain C loops: STREAM copy and triad, in-place a += s*b ("% rmw", 12 B/elem)
and an adam-shaped loop with workload (a)'s 4-in/3-out in-place streams and no real arithmetic
("% adam", 28 B/elem), each at the same thread count. Rows with "tensors" > 1 split the same 100M params into a model-like list.

DeepSpeed's DeepSpeedCPUAdam runs in a subprocess of a Python where it is importable: this one,
--deepspeed-python, or /tmp/dsvenv/bin/python. It is never a zfctl dependency. A throw-away venv
that reuses this venv's torch (no multi-GB CUDA torch download; DeepSpeed JIT-builds its op once):
    python3 -m venv /tmp/dsvenv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/dsvenv/lib/python3.11/site-packages/torch.pth
    /tmp/dsvenv/bin/pip install --no-deps deepspeed hjson py-cpuinfo einops msgpack ninja pydantic packaging psutil
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

# isort: off
import zfctl  # noqa: F401  # before torch: OMP_WAIT_POLICY=PASSIVE for torch's threads, as in a zfctl run
import torch
# isort: on

HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
DS_VENV = Path("/tmp/dsvenv/bin/python")
COUNTED_BYTES = 28  # per param, both workloads (see the module docstring)

# A case: the row it fills, and a function that allocates its buffers and returns one step.
Case = tuple[dict, Callable[[], Callable[[], None]]]


def split(t: torch.Tensor, tensors: int) -> list[torch.Tensor]:
    """Views of t as `tensors` near-equal pieces (a model's parameter list)."""
    return list(t.chunk(tensors))


class Base:
    """Random params and grads made once (randn of 100M takes seconds); cases clone them."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.n, self.p, self.g = n, torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2


def torch_cases(impl: str, base: Base, threads: int, tensors: int) -> list[Case]:
    """Workload (a), and the multi-pass (b), for torch foreach/fused or DeepSpeed."""

    def make(kind: str):
        def setup():
            torch.set_num_threads(threads)
            p, g = base.p.clone(), base.g.clone()
            leaves = []
            for pp, gg in zip(split(p, tensors), split(g, tensors)):
                leaf = torch.nn.Parameter(pp)  # shares p's memory
                leaf.grad = gg
                leaves.append(leaf)
            if impl == "deepspeed":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                opt = DeepSpeedCPUAdam(leaves, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                                       weight_decay=HP["weight_decay"])
            else:
                opt = torch.optim.AdamW(leaves, **HP, **{impl: True})
            if kind == "a":
                return opt.step
            g16, out = g.to(torch.bfloat16), torch.empty(base.n, dtype=torch.bfloat16)

            def three_passes():
                g.copy_(g16)  # widen the bf16 gradient into the fp32 .grad
                opt.step()
                out.copy_(p)  # round the new params to bf16 for the upload

            return three_passes

        return setup

    key = {"impl": impl, "threads": threads, "tensors": tensors}
    cases = [({**key, "workload": "a"}, make("a"))]
    if tensors == 1 and impl != "foreach":
        cases.append(({**key, "workload": "b", "impl": f"{impl} (3 passes)"}, make("b")))
    return cases


def native_cases(base: Base, threads: int, tensors: int) -> list[Case]:
    from zfctl import _native as N

    n = base.n
    # ZenFlow's real call: one call over the 90% of columns the CPU owns, given as a run list
    # (4096-row column-major weights, every 10th column excluded: the GPU's top-k).
    cols = torch.arange(n // 4096)
    keep = cols[cols % 10 != 0]
    runs = torch.stack([keep * 4096, torch.full_like(keep, 4096)], 1)

    def make(kind: str):
        def setup():
            N.set_num_threads(threads)
            torch.set_num_threads(threads)
            p, g, m, v = base.p.clone(), base.g.clone(), torch.zeros(n), torch.zeros(n)
            g16, out = g.to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
            views = list(zip(*(split(t, tensors) for t in (p, g, m, v))))
            step = [0]

            def adam(pp, gg, mm, vv, **kw):
                N.adamw_step(pp, gg, mm, vv, step=step[0], lr=HP["lr"], beta1=HP["betas"][0],
                             beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"], **kw)

            def one():
                step[0] += 1
                if kind == "a":
                    adam(p, g, m, v)
                elif kind == "runs":
                    adam(p, g, m, v, runs=runs)
                elif kind == "runs-out":  # the CPU worker's call: fp32 sum in, bf16 upload out (offload/host.py)
                    adam(p, g, m, v, runs=runs, out=out)
                elif kind == "b":
                    adam(p, g16, m, v, out=out)
                else:  # one call per tensor: what a call costs
                    for pp, gg, mm, vv in views:
                        adam(pp, gg, mm, vv)

            return one

        return setup

    key = {"impl": f"zfctl ({N.isa()})", "threads": threads, "tensors": 1, "workload": "a"}
    cases = [(key, make("a")), ({**key, "workload": "b", "impl": "zfctl (1 pass)"}, make("b"))]
    if tensors > 1:
        cases.append(({**key, "impl": "zfctl, one call per tensor", "tensors": tensors}, make("per-tensor")))
        cases.append(({**key, "impl": f"zfctl, 90% in {len(keep)} runs", "fraction": len(keep) * 4096 / n},
                      make("runs")))
        cases.append(({**key, "impl": f"zfctl, 90% in {len(keep)} runs, bf16 out", "fraction": len(keep) * 4096 / n,
                       "bytes": COUNTED_BYTES + 2}, make("runs-out")))
    return cases


def measure(cases: list[Case], steps: int, samples: dict[str, list[float]]) -> None:
    """One round: each case allocates, warms up (page faults, lazy optimizer state), runs
    `steps` timed steps, and frees its buffers before the next case."""
    for key, setup in cases:
        fn = setup()
        fn()
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            samples.setdefault(json.dumps(key, sort_keys=True), []).append((time.perf_counter() - t0) * 1e3)
        del fn
        gc.collect()
        time.sleep(0.05)  # let torch's OpenMP workers stop spinning before the next case


def best_ms(fn, steps: int) -> float:
    """Fastest of `steps` calls after one warm-up: STREAM's convention for a bandwidth ceiling."""
    fn()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return min(samples)


# Plain C loops (compiled here with -O3 -march=native, no zfctl code): STREAM's copy and triad,
# STREAM-style in-place a += s*b, and "adam" = the same 4-in/3-out in-place streams as workload
# (a) with no arithmetic to speak of: the ceiling for any AdamW on this machine.
PROBE_C = r"""
void copy(float *a, const float *b, long n) { for (long i = 0; i < n; i++) a[i] = b[i]; }
void triad(float *a, const float *b, const float *c, long n) { for (long i = 0; i < n; i++) a[i] = b[i] + 0.5f * c[i]; }
void rmw(float *a, const float *b, long n) { for (long i = 0; i < n; i++) a[i] += 1e-6f * b[i]; }
void adam(float *p, const float *g, float *m, float *v, long n)
{ for (long i = 0; i < n; i++) { float x = 1e-6f * g[i]; p[i] += x; m[i] += x; v[i] += x; } }
"""
PROBE_BYTES = {"copy": 8, "triad": 12, "rmw": 12, "adam": 28}


def probe_lib():
    """Build the probe loops into a temporary cffi module (a second or two, once per run)."""
    import importlib.util
    import tempfile

    from cffi import FFI

    ffi = FFI()
    ffi.cdef("void copy(float*, const float*, long); void triad(float*, const float*, const float*, long);"
             "void rmw(float*, const float*, long); void adam(float*, const float*, float*, float*, long);")
    ffi.set_source("_zf_stream_probe", PROBE_C, extra_compile_args=["-O3", "-march=native"])
    so = ffi.compile(tmpdir=tempfile.mkdtemp(prefix="zf-probe-"))
    spec = importlib.util.spec_from_file_location("_zf_stream_probe", so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe(n: int, threads: int, steps: int) -> dict[str, float]:
    """GB/s of each probe loop over n fp32 elements (STREAM byte counting: write-allocate not
    counted), best of `steps`. `threads` Python threads each run the loop on a contiguous share;
    cffi releases the GIL, so they run in parallel without any thread pool of ours."""
    mod = probe_lib()
    arrays = [torch.randn(n) for _ in range(4)]
    parts = [[ffi_ptr(mod.ffi, t[i * n // threads:(i + 1) * n // threads]) for t in arrays] for i in range(threads)]
    size = [n * (i + 1) // threads - n * i // threads for i in range(threads)]
    calls = {
        "copy": lambda a, b, c, d, k: mod.lib.copy(a, b, k),
        "triad": lambda a, b, c, d, k: mod.lib.triad(a, b, c, k),
        "rmw": lambda a, b, c, d, k: mod.lib.rmw(a, b, k),
        "adam": lambda a, b, c, d, k: mod.lib.adam(a, b, c, d, k),
    }
    result = {}
    for name, call in calls.items():
        def run(call=call):
            pool = [threading.Thread(target=call, args=(*parts[i], size[i])) for i in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        result[name] = PROBE_BYTES[name] * n / (best_ms(run, steps) * 1e-3) / 1e9
    return result


def ffi_ptr(ffi, t: torch.Tensor):
    return ffi.cast("float *", t.data_ptr())


def deepspeed_round(exe: str, args) -> dict[str, list[float]]:
    """One round of the DeepSpeed cases in a Python that has it (a subprocess: its own torch)."""
    cmd = [exe, __file__, "--deepspeed-worker", "--params", str(args.params), "--steps", str(args.steps),
           "--threads", args.threads, "--tensors", str(args.tensors)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"DeepSpeed run failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def find_deepspeed(python: str | None) -> tuple[str | None, str]:
    candidates = [python] if python else [sys.executable] + ([str(DS_VENV)] if DS_VENV.exists() else [])
    for exe in candidates:
        try:
            found = subprocess.run([exe, "-c", "import deepspeed.ops.adam"], check=False, capture_output=True)
        except OSError:  # no such python
            continue
        if found.returncode == 0:
            return exe, f"DeepSpeed from {exe}"
    return None, f"DeepSpeed: not importable from {', '.join(candidates)} (see this script's docstring); skipped"


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
    header = "| workload | implementation | threads | tensors | ms/step (median) | best | Gparams/s | GB/s | % rmw | % adam |"
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        n = r["params"] * r.get("fraction", 1.0)
        gbs = r.get("bytes", COUNTED_BYTES) * n / (r["ms"] * 1e-3) / 1e9
        pr = probes[r["threads"]]
        lines.append(f"| ({r['workload']}) | {r['impl']} | {r['threads']} | {r['tensors']} | {r['ms']:.1f} | "
                     f"{r['best']:.1f} | {n / (r['ms'] * 1e-3) / 1e9:.2f} | {gbs:.1f} | "
                     f"{100 * gbs / pr['rmw']:.0f}% | {100 * gbs / pr['adam']:.0f}% |")
    return "\n".join(lines)


def compare_one(base: Base, threads: int, repeats: int) -> dict:
    """One row of --compare: zfctl's AdamW and torch's fused CPU AdamW, alternating step by step."""
    from zfctl import _native as N

    N.set_num_threads(threads)
    torch.set_num_threads(threads)
    n = base.n
    p, g, m, v = base.p.clone(), base.g.clone(), torch.zeros(n), torch.zeros(n)
    leaf = torch.nn.Parameter(base.p.clone())
    leaf.grad = base.g.clone()
    opt = torch.optim.AdamW([leaf], **HP, fused=True)
    step = [0]

    def native() -> None:
        step[0] += 1
        N.adamw_step(p, g, m, v, step=step[0], lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1],
                     eps=HP["eps"], weight_decay=HP["weight_decay"])

    times: dict[str, list[float]] = {"zfctl": [], "torch": []}
    for r in range(repeats + 2):  # two warm-up pairs: page faults, torch's lazy state
        pair = [("zfctl", native), ("torch", opt.step)]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            t0 = time.perf_counter()
            fn()
            if r >= 2:
                times[name].append((time.perf_counter() - t0) * 1e3)
    ratios = [b / a for a, b in zip(times["zfctl"], times["torch"])]
    stats = {f"{k}_{stat}": f(v) for k, v in times.items() for stat, f in (("min", min), ("median", statistics.median))}
    return {"threads": threads, "params": n, "repeats": repeats, **stats,
            "paired_median_ratio": statistics.median(ratios)}


def compare(n: int, threads: list[int], repeats: int) -> list[dict]:
    """--compare: one row per thread count (each allocates and frees its own buffers)."""
    base = Base(n)
    rows = []
    for t in threads:
        rows.append(compare_one(base, t, repeats))
        gc.collect()
    return rows


def compare_table(rows: list[dict]) -> str:
    lines = [("| threads | zfctl min | zfctl median | torch fused min | torch fused median | torch/zfctl min "
              "| torch/zfctl median | paired median |"), "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['zfctl_min']:.1f} | {r['zfctl_median']:.1f} | {r['torch_min']:.1f} | "
                     f"{r['torch_median']:.1f} | x{r['torch_min'] / r['zfctl_min']:.2f} | "
                     f"x{r['torch_median'] / r['zfctl_median']:.2f} | x{r['paired_median_ratio']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6, help="parameters per step (default 100M)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all cases (interleaved)")
    ap.add_argument("--threads", default="1,all", help="comma list of thread counts; 'all' = CPUs available")
    ap.add_argument("--tensors", type=int, default=400, help="also time a model-like list of this many tensors")
    ap.add_argument("--busy", type=int, default=0, help="run this many CPU-spinning processes meanwhile")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed rows")
    ap.add_argument("--deepspeed-python", default=None, help="a python with deepspeed importable")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--deepspeed-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compare", action="store_true",
                    help="only zfctl vs torch fused AdamW, paired (default 24M params, threads 1,2)")
    ap.add_argument("--repeats", type=int, default=30, help="--compare: timed steps of each per thread count")
    args = ap.parse_args()
    if args.compare:
        from zfctl import _native as N

        n = int(args.params if "--params" in sys.argv else 24e6)
        spec = args.threads if "--threads" in sys.argv else "1,2"
        load0 = os.getloadavg()[0]
        rows = compare(n, thread_counts(spec), args.repeats)
        print(f"# zfctl ({N.isa()}) vs torch {torch.__version__} AdamW(fused=True), {n / 1e6:.0f}M fp32 params, "
              f"{args.repeats} paired steps; ms per step; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
        print(compare_table(rows))
        if args.json:
            args.json.write_text(json.dumps({"compare": rows}, indent=1))
        return
    base = Base(int(args.params))
    threads = thread_counts(args.threads)

    if args.deepspeed_worker:  # child: one round of DeepSpeed samples as one JSON line
        cases = [c for t in threads for k in sorted({1, args.tensors}) for c in torch_cases("deepspeed", base, t, k)]
        samples: dict[str, list[float]] = {}
        measure(cases, args.steps, samples)
        print(json.dumps(samples))
        return

    from zfctl import _native as N

    load0 = os.getloadavg()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
    print(f"# {cpu}; {len(os.sched_getaffinity(0))} CPUs; zfctl path {N.isa()}; torch {torch.__version__}; "
          f"{base.n / 1e6:.0f}M params; {args.rounds} rounds x {args.steps} steps; load average {load0[0]:.2f}"
          + (f"; {args.busy} busy-spinning processes alongside" if args.busy else ""))
    ds_exe, ds_note = (None, "DeepSpeed: skipped (--no-deepspeed)") if args.no_deepspeed else find_deepspeed(
        args.deepspeed_python
    )
    cases: list[Case] = []
    for t in threads:
        cases += native_cases(base, t, args.tensors)
        cases += torch_cases("foreach", base, t, 1) + torch_cases("fused", base, t, 1)
        if args.tensors > 1:
            cases += torch_cases("fused", base, t, args.tensors)
    hogs = start_hogs(args.busy)
    samples: dict[str, list[float]] = {}
    probes: dict[int, dict[str, float]] = {}
    for _ in range(args.rounds):
        for t in threads:
            got = probe(base.n, t, args.steps)
            probes[t] = {k: max(v, probes.get(t, {}).get(k, 0.0)) for k, v in got.items()}
        measure(cases, args.steps, samples)
        if ds_exe:
            for key, values in deepspeed_round(ds_exe, args).items():
                samples.setdefault(key, []).extend(values)
    for h in hogs:
        h.terminate()
    rows = [{**json.loads(k), "params": base.n, "ms": statistics.median(v), "best": min(v)} for k, v in samples.items()]
    rows.sort(key=lambda r: (r["workload"], r["threads"]))
    print(f"# {ds_note}")
    for t, pr in probes.items():
        print(f"# probe (C loops), {t} thread(s): copy {pr['copy']:.1f} GB/s, triad {pr['triad']:.1f} GB/s, "
              f"in-place rmw a+=s*b {pr['rmw']:.1f} GB/s, adam-shaped 4-in/3-out {pr['adam']:.1f} GB/s")
    print(f"# counted bytes: {COUNTED_BYTES} B/param for (a) and (b); load average after: {os.getloadavg()[0]:.2f}")
    print(table(rows, probes))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "probes": probes, "load": [load0, os.getloadavg()]}, indent=1))


if __name__ == "__main__":
    main()
