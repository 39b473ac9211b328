#!/usr/bin/env python3
"""The GPU check: `make gpu-check [PART=...] [OUT=file.json]`, or

    python3 scripts/gpu_check.py [tests|bench-b1|bench-b4|nccl|fit-24gb|all ...] [--out FILE]

Parts, each made to fit one 10-minute slot on an H100 (docs/gpu-check.md):
  tests     pytest -m gpu over tests/: passed/failed/skipped counts and the failing test ids
  bench-b1  scripts/bench_zenflow_gpu.sh llama at batch 1: llama3.2-1b shape, seq 1024, bf16,
            presets off, zero-offload, paper, default (host accumulation), default (device)
  bench-b4  the same at batch 4
  nccl      `zfctl finetune tiny-llama --nproc 2` on CUDA with NCCL, once per gradient path that
            exchanges differently (NCCL_VARIANTS: accumulate host with the gradient hooks and
            page-locked memory, accumulate device); skipped below 2 GPUs
  fit-24gb  the "Llama-2-7B on a 24 GB GPU" plan (docs/gpu-check.md), scaled to the lent machine's 64 GiB disk:
            scripts/gpu_7b.py fit with llama2-7b's width and FIT_LAYERS of its 32 layers (a ~28 GB
            checkpoint instead of ~130 GB), on a GPU emulated at 24 GB x its share of the 7B's
            parameters, with zfctl's --fit settings: 20 steps, peak device and host memory and
            ms/step next to the plan's figures
  all       the five in turn (more than one slot)

The bench parts' JSON carries each configuration's bound (zfctl/bench/bound.py: the slowest of
device compute, PCIe each way and host memory for the bytes its ledger counted); the check holds
each gradient path (default-host, default-device) to 1.3x of it at both batches (gpu_results.py
``within_bound``; device compute from the batch's `off` row), and each path's selection steps
to 2x its ordinary steps (``selection_cost``: the timed selection steps' mean over the median of
the steps that neither select nor end an interval).

Each part adds its results to ONE JSON file (default bench-results/gpu-check-<commit>.json; a
file of another commit is refused), then the acceptance figures are recomputed from everything
the file holds, so parts run in separate slots add up. Raw outputs (logs, every bench JSON) go
to the folder beside it (FILE without .json).

Runs with python3 (whatever runs this script; `make gpu-check PYTHON=...`), never .venv: `make
setup` installs torch from PyPI, impossible offline. Standard library only in this process.
Without CUDA: one line "gpu-check SKIPPED: ..." and exit 0, nothing installed, run or written.
Exit 1 when a part failed or an acceptance figure misses its target (a figure not measured yet
is "missing", which is no failure and no pass); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ROOT, Failed, git_commit, load_doc, machine, prepare, probe, run_logged, write_doc
from gpu_results import PARTS, PRESETS, collect_bench, merge, summary_lines

# fit-24gb: llama2-7b (scripts/gpu_7b.yaml) with this many decoder layers: 1.48B parameters, whose
# checkpoint (bf16 weights + fp32 optimizer state, ~19 B per parameter) is ~28 GB.
FIT_LAYERS = 6
FIT_FULL_GPU_GB = 24.0  # the row it scales: Llama-2-7B on a 24 GB GPU


def llama2_7b_params(layers: int) -> int:
    """Parameters of scripts/gpu_7b.yaml's Llama with ``layers`` decoder layers (untied head)."""
    vocab, h, inter = 32000, 4096, 11008
    return 2 * vocab * h + layers * (4 * h * h + 3 * h * inter + 2 * h) + h


def scaled_gpu_memory(layers: int, full_gb: float = FIT_FULL_GPU_GB) -> str:
    """The GPU size that is to ``layers`` layers what ``full_gb`` is to the whole 7B, by
    parameters (rounded up to 0.1 GB): the buffers that do not scale with the model (install
    staging, activations of one 512-token sequence) make the small row a little harder."""
    gb = math.ceil(full_gb * llama2_7b_params(layers) / llama2_7b_params(32) * 10) / 10
    return f"{gb:g}GB"


# Steps of the NCCL smoke run: default's 20 full-CPU warm-up steps, then 20 ZenFlow steps (5 CPU
# updates, each broadcast by its owner rank).
NCCL_STEPS = 40
# The NCCL runs, named: on CUDA `accumulate: auto` picks `device` for tiny-llama, so a run left to
# auto would never exchange inside the gradient hooks nor DMA from page-locked host memory.
NCCL_VARIANTS = {
    "host": ["zenflow.accumulate=host", "zenflow.tuning.pin_memory=true"],
    "device": ["zenflow.accumulate=device", "zenflow.tuning.pin_memory=true"],
}


# -- the parts -----------------------------------------------------------------------------------------

@dataclass
class Context:
    py: str
    env: dict[str, str]
    raw: Path  # this run's raw outputs
    gpus: int
    timeout: float  # per part


def _fresh(folder: Path) -> Path:
    """An empty folder for one part's raw files (stale ones from an earlier run must not be read)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def _status(code: int | None) -> str:
    return "timed out" if code is None else "passed" if code == 0 else "failed"


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and ids from pytest's --junitxml (junit_family xunit1, which names each test's file)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[str] = []
    skipped: list[dict[str, str]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file, cls, name = case.get("file") or "", case.get("classname") or "", case.get("name") or ""
        module = file.removesuffix(".py").replace("/", ".")
        inner = cls[len(module) + 1:] if module and cls.startswith(module + ".") else ""
        test_id = "::".join(p for p in (file or cls, inner, name) if p)
        tags = {child.tag: child for child in case}
        if "failure" in tags or "error" in tags:
            counts["failed" if "failure" in tags else "errors"] += 1
            failing.append(test_id)
        elif "skipped" in tags:
            counts["skipped"] += 1
            skipped.append({"id": test_id, "reason": tags["skipped"].get("message", "")})
        else:
            counts["passed"] += 1
    return {**counts, "failing": failing, "skipped_ids": skipped}


def part_tests(ctx: Context) -> dict[str, Any]:
    raw = _fresh(ctx.raw / "tests")
    junit = raw / "junit.xml"
    cmd = [ctx.py, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
           f"--junitxml={junit}", "tests"]
    code, secs = run_logged(cmd, raw / "pytest.log", timeout=ctx.timeout, env=ctx.env)
    section: dict[str, Any] = {"exit_code": code}
    if junit.exists():
        section.update(parse_junit(junit))
    status = _status(code)
    if code == 5:  # pytest: no test was collected; on a GPU machine that is a broken check
        status = "failed"
    return {"status": status, "seconds": round(secs, 1), "log": str(raw / "pytest.log"), "section": section}


def part_bench(ctx: Context, batch: int) -> dict[str, Any]:
    raw = _fresh(ctx.raw / f"bench-b{batch}")
    env = {**ctx.env, "BATCHES": str(batch), "PY": ctx.py}
    code, secs = run_logged(["bash", "scripts/bench_zenflow_gpu.sh", "llama", str(raw)], raw / "bench.log",
                            timeout=ctx.timeout, env=env)
    section = collect_bench(raw)
    missing = [p for p in PRESETS if p not in section.get(f"b{batch}", {})]
    result = {"status": _status(code), "seconds": round(secs, 1), "log": str(raw / "bench.log"), "section": section}
    if missing:
        result.update(status="failed" if code is not None else "timed out", missing=missing)
    return result


def nccl_skip_reason(gpus: int) -> str | None:
    return None if gpus >= 2 else f"needs 2 CUDA GPUs, this machine has {gpus}"


def nccl_summary(metrics: Path, code: int | None, steps: int) -> dict[str, Any]:
    """What the 2-process run's metrics.jsonl shows; passed = it ran every step, finite losses,
    and the ranks exchanged bytes."""
    recs = []
    if metrics.exists():
        recs = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "train"]
    losses = [r["loss"] for r in recs]
    comm = [r.get("comm_bytes", 0) for r in recs]
    ok = (code == 0 and len(recs) == steps and bool(recs) and recs[-1]["step"] == steps
          and all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses) and min(comm, default=0) > 0)
    return {"status": "passed" if ok else _status(code) if code != 0 else "failed", "exit_code": code,
            "steps": len(recs), "want_steps": steps, "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "comm_bytes_per_step": sum(comm) / len(comm) if comm else None,
            "ms_per_step_mean": sum(r["step_ms"] for r in recs) / len(recs) if recs else None}


def part_nccl(ctx: Context) -> dict[str, Any]:
    why = nccl_skip_reason(ctx.gpus)
    if why:
        return {"status": "skipped", "reason": why, "seconds": 0.0, "section": {"status": "skipped", "reason": why}}
    raw = _fresh(ctx.raw / "nccl")
    variants: dict[str, Any] = {}
    total = 0.0
    for name, sets in NCCL_VARIANTS.items():
        left = ctx.timeout - total
        if left <= 0:
            variants[name] = {"status": "timed out", "exit_code": None, "sets": sets}
            continue
        cmd = [ctx.py, "-m", "zfctl", "finetune", "tiny-llama", "--data", "alpaca-sample", "--nproc", "2",
               "--max-steps", str(NCCL_STEPS), "--set", "train.device=cuda", "--set", "distributed.backend=nccl",
               *(a for s in sets for a in ("--set", s)), "--output", str(raw / f"run-{name}"), "--force"]
        code, secs = run_logged(cmd, raw / f"finetune-{name}.log", timeout=left, env=ctx.env)
        total += secs
        variants[name] = {**nccl_summary(raw / f"run-{name}" / "metrics.jsonl", code, NCCL_STEPS), "sets": sets}
    statuses = {v["status"] for v in variants.values()}
    status = "passed" if statuses == {"passed"} else "timed out" if "timed out" in statuses else "failed"
    return {"status": status, "seconds": round(total, 1), "log": str(raw),
            "section": {"status": status, "variants": variants}}


def fit_section(path: Path, size: str) -> dict[str, Any]:
    """What scripts/gpu_7b.py recorded of the emulated run: the plan's figures and --fit's changes
    beside the measured peaks and ms/step."""
    if not path.exists():
        return {"status": "missing", "emulated_gpu": size, "why": f"{path.name} was not written"}
    doc = json.loads(path.read_text())
    plan, part = doc.get("plan") or {}, (doc.get("parts") or {}).get("fit") or {}
    return {"status": part.get("status", "missing"), "emulated_gpu": size, "layers": FIT_LAYERS,
            "params": (plan.get("size") or {}).get("params"), "fit": doc.get("fit"),
            "plan_fits": plan.get("fits"), "plan_device_bytes": plan.get("device_total"),
            "plan_host_bytes": plan.get("host_total"), "activation_checkpointing": plan.get("activation_checkpointing"),
            "topk_ratio": plan.get("topk_ratio"), "peak_device_bytes": part.get("peak_device_bytes"),
            "peak_host_rss_bytes": part.get("peak_host_rss_bytes"), "ms_per_step_zenflow": part.get("ms_per_step_zenflow"),
            "summary": doc.get("summary"), "reason": part.get("reason") or part.get("last_line")}


def part_fit(ctx: Context) -> dict[str, Any]:
    raw = _fresh(ctx.raw / "fit-24gb")
    size = scaled_gpu_memory(FIT_LAYERS)
    cmd = [ctx.py, "scripts/gpu_7b.py", "fit", "--layers", str(FIT_LAYERS), "--emulate-gpu-memory", size,
           "--out", str(raw / "gpu-7b.json"), "--run-dir", str(raw / "run"),
           "--part-timeout", str(max(60.0, ctx.timeout - 90))]  # its plan and setup run before the part
    code, secs = run_logged(cmd, raw / "gpu-7b.log", timeout=ctx.timeout, env=ctx.env)
    section = fit_section(raw / "gpu-7b.json", size)
    if section["status"] == "missing" and (raw / "gpu-7b.log").exists():  # e.g. --fit found nothing: its line
        tail = [ln for ln in (raw / "gpu-7b.log").read_text(errors="replace").splitlines() if ln.strip()]
        section["reason"] = tail[-1] if tail else None
    shutil.rmtree(raw / "run", ignore_errors=True)  # its checkpoint: ~28 GB of the 64 GiB disk
    status = _status(code) if section["status"] in ("missing", "passed") else section["status"]
    return {"status": status, "seconds": round(secs, 1), "log": str(raw / "gpu-7b.log"), "section": section,
            **({"reason": section["reason"]} if section.get("reason") else {})}


def run_part(ctx: Context, part: str) -> dict[str, Any]:
    if part == "tests":
        return part_tests(ctx)
    if part == "fit-24gb":
        return part_fit(ctx)
    if part == "nccl":
        return part_nccl(ctx)
    return part_bench(ctx, int(part.removeprefix("bench-b")))


# -- main ----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", metavar="PART",
                    help="tests, bench-b1, bench-b4, nccl, fit-24gb or all (default)")
    ap.add_argument("--out", type=Path, help="results file (default bench-results/gpu-check-<commit>.json)")
    # 480 s: a 10-minute slot minus this script's setup on a fresh machine (wheels, the module check,
    # the native build: ~1 minute) and the 30 s it may take to stop a part and write the file.
    ap.add_argument("--part-timeout", type=float, default=480,
                    help="seconds each part may run before it is stopped (default 480)")
    args = ap.parse_args(argv)
    for p in args.parts:
        if p not in (*PARTS, "all"):
            ap.error(f"part {p!r}: use {', '.join(PARTS)} or all")
    parts = list(PARTS) if not args.parts or "all" in args.parts else list(dict.fromkeys(args.parts))

    py = sys.executable
    info = probe(py)
    if not info.get("gpus"):
        print(f"gpu-check SKIPPED: no CUDA GPU here ({info.get('why')}); nothing was run or written")
        return 0
    commit = git_commit()
    out = (args.out or ROOT / "bench-results" / f"gpu-check-{commit}.json").resolve()
    try:
        doc = load_doc(out, commit)
        env = prepare(py, info.get("ext_suffix"))
    except Failed as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 1
    ctx = Context(py=py, env=env, raw=out.with_suffix(""), gpus=int(info["gpus"]), timeout=args.part_timeout)
    host = machine(info)
    for part in parts:
        print(f"== gpu-check {part}", flush=True)
        doc = merge(doc, part, run_part(ctx, part), host)
        write_doc(out, doc)  # after every part: a later part's time-out keeps this one's results
    print("\n".join(summary_lines(doc)))
    print(f"results: {out}")
    return 1 if doc["verdict"]["result"] == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
