#!/usr/bin/env python3
"""A 7B fine-tune on one GPU, measured against the plan's memory estimate:

    python3 scripts/gpu_7b.py [train|resume|all|fit] [--disk full|small] [--out FILE] [--run-dir DIR]
                              [--set KEY=VALUE ...] [--emulate-gpu-memory 24GB] [--layers N]

llama2-7b's architecture with random init (scripts/gpu_7b.yaml: embedded tokenizer, alpaca-sample
packed into 1 x 512-token steps), bf16, ZenFlow default. Part `train`: `zfctl finetune
--max-steps 10`, which ends with the checkpoint of step 10; part `resume`: `zfctl resume
--max-steps 20` from it. Each part is meant for its own 10-minute slot (a 7B build and its
~110 GB of host state take minutes); both add to one JSON file (default
bench-results/gpu-7b-<commit>.json) with `zfctl plan --json`'s memory figures beside:

- peak host RSS of the training process: its VmHWM, read from /proc from outside every 0.5 s
  (also for any process it starts) and by the process itself at exit (scripts/zf_memstats.py),
  plus metrics.jsonl's `host_peak_gib` (the process's VmHWM);
- pinned host bytes: the caching host allocator's peak plus the peak of the bytes zfctl
  registers itself (zfctl.offload.device.pinned.registered_bytes(), null where this build lacks it);
  the two peaks may not coincide, so their sum is an upper bound;
- peak device memory (allocated and reserved) and ms/step from metrics.jsonl, ZenFlow steps
  apart from the full-CPU warm-up steps.
Not measured: host memory pinned by the CUDA driver outside torch and zfctl (its own staging),
and RSS of a process killed before it could write its stats (the outside poll still has it).

A smaller GPU, emulated (the 24 GB Llama-2-7B row of docs/memory.md on an 80 GB card): ``--emulate-gpu-memory 24GB``
plans for a GPU of that size with ``zfctl plan --gpu-memory 24GB --fit`` (recorded as ``fit``:
the ``--set`` changes it made), runs ``zfctl finetune`` with the same ``--gpu-memory 24GB --fit``,
and caps the training process with ``torch.cuda.set_per_process_memory_fraction(24 GB / the
card's memory)`` (scripts/zf_memstats.py ``--cap-gpu-memory``), so an estimate that is too low
ends in an out-of-memory error instead of a pass. Part ``fit`` is one run of ``--steps`` steps
(one checkpoint, at its end) for that. ``--layers N`` keeps llama2-7b's width and vocabulary
with N decoder layers: the size `make gpu-check` runs (scripts/gpu_check.py), whose checkpoint
fits the lent machine's disk.

Before running, it refuses in one line when the plan says this machine cannot hold the run
(--force-run overrides) or the part's checkpoint cannot fit on the run folder's disk (a 7B
checkpoint is ~130 GB: weights + fp32 master, moments and accumulator). Without CUDA: one
SKIPPED line, exit 0.

``--disk small`` fits a machine with 64 GiB of disk (the lent GPU machines): llama2-7b's shapes
with 8 of its 32 layers (1.9B params, a ~36 GB checkpoint, ~45 GB host), so every matrix, the
vocabulary ones included, has its 7B shape and takes the same code path; per-layer figures
compare, totals do not. ``/dev/shm`` is no way out: the full checkpoint is RAM the run itself
needs. The mode is printed first and recorded in the results (``setup.disk``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (
    ROOT,
    Failed,
    TreeSampler,
    capture,
    git_commit,
    load_doc,
    machine,
    prepare,
    probe,
    run_logged,
    stamp,
    write_doc,
)

CONFIG = "scripts/gpu_7b.yaml"
BASE = ["llama2-7b", "--data", "alpaca-sample", "--config", CONFIG]
# --disk: the plan overrides of each mode (before the user's --set, which may override them).
DISK_MODES = {
    "full": ([], "llama2-7b, 32 layers: 6.74B params, a ~130 GB checkpoint"),
    "small": (["model.config.num_hidden_layers=8"],
              "llama2-7b's shapes with 8 of 32 layers: 1.88B params, a ~36 GB checkpoint (fits 64 GiB of disk)"),
}

PLAN_DOES_NOT_FIT = 3  # zfctl plan's exit code when the machine cannot hold the plan (zfctl/cli/plan.py)
_UNITS = {"gb": 10**9, "gib": 2**30}


def parse_gpu_memory(text: str) -> int:
    """Bytes of ``24GB`` (decimal, as zfctl plan reads it) or ``24GiB``; ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r}: give a size such as 24GB or 24GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def emulation_flags(size: str | None, layers: int | None) -> tuple[list[str], list[str]]:
    """(plan and finetune flags, zf_memstats flags) for an emulated GPU of ``size`` and a model of
    ``layers`` decoder layers; ([], []) for the real card and the whole 7B."""
    sets = ["--set", f"model.config.num_hidden_layers={layers}"] if layers else []
    if size is None:
        return sets, []
    return [*sets, "--gpu-memory", size, "--fit"], ["--cap-gpu-memory", str(parse_gpu_memory(size))]


def agg(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values) if values else None,
            "median": statistics.median(values) if values else None, "n": len(values)}


def phase_metrics(metrics: Path, first: int, last: int) -> dict[str, Any]:
    """What metrics.jsonl says of steps first..last: ms/step (ZenFlow steps without the part's
    first step, which pays for CUDA and allocator warm-up; and the full-CPU warm-up steps), peaks."""
    recs = [r for r in _records(metrics) if r.get("kind") == "train" and first <= r["step"] <= last]
    zen = [r for r in recs if not r.get("warmup") and r["step"] != first]
    dev = [r["device_peak_gib"] for r in recs if r.get("device_peak_gib") is not None]
    return {
        "first_step": recs[0]["step"] if recs else None,
        "last_step": recs[-1]["step"] if recs else None,
        "ms_per_step_zenflow": agg([r["step_ms"] for r in zen]),
        "ms_per_step_warmup": agg([r["step_ms"] for r in recs if r.get("warmup")]),
        "stall_ms_per_step_zenflow": agg([r["stall_ms"] for r in zen])["mean"],
        "cpu_update_ms": agg([r["cpu_step_ms"] for r in recs if r.get("cpu_step_ms")])["mean"],
        "metrics_host_peak_bytes": int(max(r["host_peak_gib"] for r in recs) * 2**30) if recs else None,
        "metrics_device_peak_bytes": int(max(dev) * 2**30) if dev else None,
        "loss_first": recs[0]["loss"] if recs else None,
        "loss_last": recs[-1]["loss"] if recs else None,
    }


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the torn last line of a killed run
            continue
    return out


def part_record(code: int | None, secs: float, log: Path, tree: TreeSampler, stats: Path,
                metrics: dict[str, Any]) -> dict[str, Any]:
    own = json.loads(stats.read_text()) if stats.exists() else {}
    cache, reg = own.get("caching_allocator_peak_bytes"), own.get("registered_peak_bytes")
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] \
        if log.exists() else []
    return {
        "status": "timed out" if code is None else "passed" if code == 0 else "failed",
        "exit_code": code, "seconds": round(secs, 1), "log": str(log),
        "last_line": tail[0] if tail and code != 0 else None,
        "peak_host_rss_bytes": {"outside_vmhwm": tree.result()["max_process_vmhwm_bytes"],
                                "tree_rss_sum": tree.result()["tree_rss_peak_bytes"],
                                "own_vmhwm": own.get("vm_hwm_bytes"),
                                "metrics_host_peak": metrics["metrics_host_peak_bytes"]},
        "pinned_host_bytes": {"caching_allocator_peak": cache, "zfctl_registered_peak": reg,
                              "zfctl_registered_available": own.get("registered_available"),
                              "total_upper_bound": None if cache is None and reg is None
                              else (cache or 0) + (reg or 0)},
        "peak_device_bytes": {"allocated": own.get("device_allocated_peak_bytes") or
                              metrics["metrics_device_peak_bytes"],
                              "reserved": own.get("device_reserved_peak_bytes")},
        **{k: v for k, v in metrics.items() if not k.startswith("metrics_")},
    }


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """The peaks over the parts that ran, next to the plan's totals."""
    parts = [p for p in doc.get("parts", {}).values() if "peak_host_rss_bytes" in p]

    def peak(get) -> int | None:
        vals = [v for v in map(get, parts) if v is not None]
        return max(vals) if vals else None

    # Both are the main process's VmHWM: the process's own reading at exit is exact, the outside
    # poll (0.5 s) the one left when it was killed.
    host = peak(lambda p: max((v for k, v in p["peak_host_rss_bytes"].items() if k in ("outside_vmhwm", "own_vmhwm")
                               and v is not None), default=None))
    dev = peak(lambda p: p["peak_device_bytes"]["reserved"] or p["peak_device_bytes"]["allocated"])
    plan = doc.get("plan", {})
    cap = (doc.get("emulation") or {}).get("gpu_memory_bytes")
    # torch's reserved peak sees its caching allocator only; the plan's CUDA-context line
    # (zfctl/plan/lines.py CUDA_CONTEXT) is memory outside it, so it is not what the peak is read against.
    context = sum(i.get("bytes", 0) for i in plan.get("items", []) if i.get("name") == "CUDA context")
    allocator = plan["device_total"] - context if plan.get("device_total") else None
    return {
        "device_vs_emulated_gpu": dev / cap if dev and cap else None,
        "peak_host_rss_bytes": host,
        "pinned_host_bytes_upper_bound": peak(lambda p: p["pinned_host_bytes"]["total_upper_bound"]),
        "peak_device_bytes": dev,
        "host_vs_plan": host / plan["host_total"] if host and plan.get("host_total") else None,
        "device_vs_plan": dev / allocator if dev and allocator else None,
    }


def preflight(plan: dict[str, Any], run_dir: Path, bytes_per_param: int | None, force: bool,
              *, check_plan: bool = True) -> str | None:
    """Why this machine cannot run a part (None when it can): the plan's verdict on its memory
    (train only: a resume needs what the run it continues needed), then the disk for the one
    checkpoint the part writes at its end."""
    if check_plan and not plan.get("fits", True) and not force:
        return f"zfctl plan says this machine cannot run it: {'; '.join(plan.get('reasons', []))} (--force-run tries anyway)"
    params = plan.get("size", {}).get("params")
    if bytes_per_param and params:
        need = params * (2 + bytes_per_param)  # bf16 weights + the optimizer state, per parameter
        probe_dir = next(p for p in (run_dir, *run_dir.parents) if p.exists())
        free = shutil.disk_usage(probe_dir).free
        if need > free:
            return (f"its checkpoint needs ~{need / 1e9:.0f} GB, {free / 1e9:.0f} GB is free at {probe_dir}: "
                    "give --run-dir on a larger disk, or run --disk small")
    return None


def plan_memory(py: str, env: dict[str, str], sets: list[str], steps: int) -> dict[str, Any]:
    """`zfctl plan ... --json` for this run on this machine (or the emulated GPU): its memory
    object, with what --fit changed under ``fit`` and the resolved plan's activation checkpointing.
    A plan that does not fit is the preflight's to refuse; --fit finding nothing is a Failed."""
    res = capture([py, "-m", "zfctl", "plan", *BASE, *sets, "--max-steps", str(steps), "--json"],
                  env=env, cwd=ROOT, timeout=300)
    if res.returncode not in (0, PLAN_DOES_NOT_FIT):
        raise Failed(f"zfctl plan failed: {(res.stderr.strip().splitlines() or ['no output'])[-1]}")
    doc = json.loads(res.stdout)
    return {**doc["memory"], "fit": doc.get("fit"),
            "activation_checkpointing": doc["plan"]["train"].get("activation_checkpointing"),
            "topk_ratio": doc["plan"]["zenflow"]["topk_ratio"]}


def checkpoint_bytes_per_param(py: str, env: dict[str, str]) -> int | None:
    """The optimizer-state bytes per parameter zfctl expects in a checkpoint (None if this build
    does not say: then zfctl's own free-space check is the only one)."""
    res = capture([py, "-c", "from zfctl.train.checkpoint import OPTIMIZER_BYTES_PER_PARAM as b; print(b)"],
                  env=env, cwd=ROOT, timeout=120)
    return int(res.stdout) if res.returncode == 0 and res.stdout.strip().isdigit() else None


def run_part(part: str, args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """One part: refuse with the reason, or run it under the memory samplers and read its metrics."""
    run_dir, raw = ctx["run_dir"], ctx["raw"]
    first, last = {"train": (1, args.checkpoint_at), "fit": (1, args.steps)}.get(part, (args.checkpoint_at + 1,
                                                                                    args.steps))
    ckpt = run_dir / "checkpoints" / f"step-{args.checkpoint_at:06d}"
    if part in ("train", "fit"):
        why = preflight(ctx["plan"], run_dir, ctx["bytes_per_param"], args.force_run)
        verb = ["finetune", *BASE, *ctx["sets"], "--output", str(run_dir), "--max-steps", str(last), "--force"]
    else:
        why = (preflight(ctx["plan"], run_dir, ctx["bytes_per_param"], args.force_run, check_plan=False)
               if ckpt.is_dir() else f"no checkpoint {ckpt}: run part train first")
        verb = ["resume", str(run_dir), "--max-steps", str(last)]
    if why:
        print(f"gpu-7b {part} SKIPPED: {why}")
        return {"status": "skipped", "reason": why, "finished": stamp()}
    stats, log, tree = raw / f"{part}-stats.json", raw / f"{part}.log", TreeSampler()
    stats.unlink(missing_ok=True)
    code, secs = run_logged([ctx["py"], "scripts/zf_memstats.py", str(stats), *ctx.get("cap", []), *verb], log,
                            timeout=args.part_timeout, env=ctx["env"], poll=tree)
    metrics = phase_metrics(run_dir / "metrics.jsonl", first, last)
    return {**part_record(code, secs, log, tree, stats, metrics), "finished": stamp()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_7b.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", default="all",
                    help="train, resume, all (default: train then resume) or fit (one run of --steps)")
    ap.add_argument("--out", type=Path, help="results file (default bench-results/gpu-7b-<commit>.json)")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "gpu-7b", help="the run folder")
    ap.add_argument("--disk", choices=list(DISK_MODES), default="full",
                    help="full: the 7B (~130 GB checkpoint); small: its shapes with 8 layers (~36 GB)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--checkpoint-at", type=int, default=10)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="more plan overrides for finetune and plan (resume reads the saved plan)")
    ap.add_argument("--force-run", action="store_true", help="run even when the plan says it does not fit")
    ap.add_argument("--emulate-gpu-memory", metavar="SIZE",
                    help="plan for and cap the process to a GPU of SIZE (e.g. 24GB), with zfctl's --fit")
    ap.add_argument("--layers", type=int, help="decoder layers of the 7B (default: its 32); fewer fit a small disk")
    # 500 s: a 10-minute slot minus the setup, the plan and stopping the part (see gpu_check.py)
    ap.add_argument("--part-timeout", type=float, default=500)
    args = ap.parse_args(argv)
    if args.part not in ("train", "resume", "all", "fit"):
        ap.error(f"part {args.part!r}: use train, resume, all or fit")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers {args.layers}: must be >= 1")
    try:
        emulate, cap = emulation_flags(args.emulate_gpu_memory, args.layers)
    except ValueError as e:
        ap.error(f"--emulate-gpu-memory {e}")
    if not 0 < args.checkpoint_at < args.steps:
        ap.error(f"--checkpoint-at {args.checkpoint_at}: must be between 0 and --steps {args.steps}")

    py = sys.executable
    info = probe(py)
    if not info.get("gpus"):
        print(f"gpu-7b SKIPPED: no CUDA GPU here ({info.get('why')}); nothing was run or written")
        return 0
    commit = git_commit()
    out = (args.out or ROOT / "bench-results" / f"gpu-7b-{commit}.json").resolve()
    overrides, what = DISK_MODES[args.disk]
    if args.layers:  # an explicit layer count replaces the disk mode's
        overrides, what = [], f"llama2-7b's shapes with {args.layers} of 32 layers (--layers)"
    print(f"gpu-7b disk mode {args.disk}: {what}", flush=True)
    sets = [*(a for s in [*overrides, *args.sets] for a in ("--set", s)), *emulate]
    try:
        doc = load_doc(out, commit)
        env = prepare(py, info.get("ext_suffix"))
        memory = plan_memory(py, env, sets, args.steps)
    except (Failed, subprocess.SubprocessError) as e:
        print(f"gpu-7b: {e}", file=sys.stderr)
        return 1
    ctx = {"py": py, "env": env, "sets": sets, "plan": memory, "raw": out.with_suffix(""), "cap": cap,
           "run_dir": args.run_dir.resolve(), "bytes_per_param": checkpoint_bytes_per_param(py, env)}
    ctx["raw"].mkdir(parents=True, exist_ok=True)
    doc.update(machine=machine(info), plan=memory, parts=doc.get("parts", {}), fit=memory.get("fit"),
               emulation={"gpu_memory": args.emulate_gpu_memory, "gpu_memory_bytes": int(cap[1]) if cap else None,
                          "layers": args.layers},  # None: the disk mode's layers
               setup={"command": ["zfctl", "finetune", *BASE, *sets], "disk": args.disk, "steps": args.steps,
                      "checkpoint_at": args.checkpoint_at, "run_dir": str(ctx["run_dir"])})
    for part in (["train", "resume"] if args.part == "all" else [args.part]):
        print(f"== gpu-7b {part}", flush=True)
        doc["parts"][part] = run_part(part, args, ctx)
        doc["summary"], doc["updated"] = summarize(doc), stamp()
        write_doc(out, doc)  # after each part: the next one's time-out keeps this one's results
    print(json.dumps(doc["summary"], indent=2))
    print(f"results: {out}")
    return 0 if all(p["status"] == "passed" for p in doc["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
