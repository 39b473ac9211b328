#!/usr/bin/env python3
"""The GPU check: `make gpu-check [PART=...] [OUT=file.json]`, or

    python3 scripts/gpu_check.py [tests|bench-b1|bench-b4|nccl|all ...] [--out FILE]

Parts, each made to fit one 10-minute slot on an H100 (README, section "GPU check"):
  tests     pytest -m gpu over tests/: passed/failed/skipped counts and the failing test ids
  bench-b1  scripts/bench_zenflow_gpu.sh llama at batch 1: llama3.2-1b shape, seq 1024, bf16,
            presets off, zero-offload, paper, default (host accumulation), default (device)
  bench-b4  the same at batch 4
  nccl      `zfctl finetune tiny-llama --nproc 2` on CUDA with NCCL; skipped below 2 GPUs
  all       the four in turn (more than one slot)

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
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (
    ROOT,
    Failed,
    git_commit,
    load_doc,
    machine,
    prepare,
    probe,
    run_logged,
    stamp,
    write_doc,
)

PARTS = ("tests", "bench-b1", "bench-b4", "nccl")
PRESETS = ("off", "zero-offload", "paper", "default-host", "default-device")  # what each bench part runs
# The shape the targets are stated for; results of any other shape are kept but never compared.
SHAPE = {"model": "llama3.2-1b", "seq_len": 1024, "dtype": "bf16", "timing": "CUDA events"}
# (name, batch, configuration, baseline, target): speed = 1 / mean ms per step, so a speed ratio
# is the baseline's ms / the configuration's ms.
TARGETS = (
    ("ZenFlow default / off", 4, "default-host", "off", 0.80),
    ("ZenFlow default / zero-offload", 4, "default-host", "zero-offload", 3.0),
    ("accumulate device / off", 4, "default-device", "off", 0.90),
    ("ZenFlow default / off at batch 1", 1, "default-host", "off", 0.65),
)
# Steps of the NCCL smoke run: default's 20 full-CPU warm-up steps, then 20 ZenFlow steps (5 CPU
# updates, each broadcast by its owner rank).
NCCL_STEPS = 40


# -- from `zfctl bench --json` files to figures -------------------------------------------------------

def _mean(agg: dict | None) -> float | None:
    return agg.get("mean") if isinstance(agg, dict) else None


def figures(row: dict[str, Any], meta: dict[str, Any], source: str) -> dict[str, Any]:
    """The numbers the check reports for one bench row (None where the bench had none)."""
    ms = row["step_ms"]["overall"]
    phases = [_mean(row.get(k)) for k in ("fwd_ms", "bwd_ms", "device_opt_ms")]
    d2h = row.get("d2h_bytes_per_step")
    return {
        "source": source,
        "label": row["label"],
        "shape": {"model": meta.get("model_preset"), "batch": meta.get("batch"), "seq_len": meta.get("seq_len"),
                  "dtype": meta.get("dtype"), "timing": meta.get("timing")},
        "device": meta.get("device"),
        "accumulate": meta.get("accumulate") if row["name"] == "zenflow" else "host",
        "interval": row["interval"],
        "timed_steps": ms.get("n"),
        "ms_per_step": {"mean": ms.get("mean"), "median": ms.get("median")},
        "stall_ms_per_step": _mean(row.get("stall_ms")),
        "gpu_busy_pct": None if row.get("gpu_busy_fraction") is None else 100 * row["gpu_busy_fraction"],
        # forward + backward + device optimizer: the device's own work in one step
        "device_ms_per_step": sum(p for p in phases if p is not None) if None not in phases else None,
        "cpu_update_ms": _mean(row.get("cpu_step_ms")),
        "d2h_link_gbps": meta.get("d2h_gbps"),  # one pinned copy, measured when the bench started
        # bytes the step moved device -> host per second of step time (not the link's rate)
        "d2h_gbps_per_step": d2h / ms["mean"] / 1e6 if d2h is not None and ms.get("mean") else None,
        "d2h_bytes_per_step": d2h,
        "peak_host_rss_bytes": row.get("peak_host_rss_bytes"),
        "peak_device_allocated_bytes": row.get("peak_device_allocated_bytes"),
        "peak_device_reserved_bytes": row.get("peak_device_reserved_bytes"),
    }


BENCH_FILE = re.compile(r"llama-1b-b\d+-(?P<preset>[a-z0-9-]+)\.json")


def collect_bench(folder: Path) -> dict[str, dict[str, Any]]:
    """{'b4': {'off': figures, 'default-host': figures, ...}} from the bench JSON files in `folder`.

    Baseline rows are keyed by their name, ZenFlow rows by the preset in the file name
    (llama-1b-b<batch>-<preset>.json, as scripts/bench_zenflow_gpu.sh names them); the batch comes
    from the file's meta, not its name."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("llama-1b-b*.json")):
        m = BENCH_FILE.fullmatch(path.name)
        if m is None:
            continue
        doc = json.loads(path.read_text())
        meta = doc["meta"]
        zenflow = [r for r in doc["results"] if r["name"] == "zenflow"]
        for row in doc["results"]:
            key = row["name"] if row["name"] != "zenflow" else m["preset"]
            if row["name"] == "zenflow" and len(zenflow) > 1:
                key = f"{m['preset']}: {row['label']}"  # a grid in one file: one key per point
            out.setdefault(f"b{meta.get('batch')}", {})[key] = figures(row, meta, path.name)
    return out


# -- acceptance ---------------------------------------------------------------------------------------

def _usable(bench: dict[str, Any], batch: int, name: str) -> tuple[dict | None, str | None]:
    """(figures, None), or (None, why they cannot be compared)."""
    cfg = bench.get(f"b{batch}", {}).get(name)
    key = f"b{batch}/{name}"
    if cfg is None:
        return None, f"{key}: not measured (run part bench-b{batch})"
    shape = cfg["shape"]
    want = {**SHAPE, "batch": batch}
    if any(shape.get(k) != v for k, v in want.items()):
        got = f"{shape.get('model')} batch {shape.get('batch')} x {shape.get('seq_len')} {shape.get('dtype')}"
        return None, (f"{key}: measured on {got} ({shape.get('timing')}), the target is for "
                      f"{SHAPE['model']} batch {batch} x {SHAPE['seq_len']} {SHAPE['dtype']} timed by CUDA events")
    if not cfg["ms_per_step"]["mean"]:
        return None, f"{key}: no timed steps"
    return cfg, None


def acceptance(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: the speed ratio (by mean and by median ms/step) and pass / fail / missing."""
    out = []
    for name, batch, config, baseline, target in TARGETS:
        (cfg, why_c), (base, why_b) = _usable(bench, batch, config), _usable(bench, batch, baseline)
        entry: dict[str, Any] = {"name": name, "config": f"b{batch}/{config}", "baseline": f"b{batch}/{baseline}",
                                 "target": target, "ratio": None, "ratio_median": None}
        if cfg is None or base is None:
            entry.update(status="missing", why="; ".join(w for w in (why_c, why_b) if w))
        else:
            entry["ratio"] = base["ms_per_step"]["mean"] / cfg["ms_per_step"]["mean"]
            if cfg["ms_per_step"]["median"] and base["ms_per_step"]["median"]:
                entry["ratio_median"] = base["ms_per_step"]["median"] / cfg["ms_per_step"]["median"]
            entry["status"] = "pass" if entry["ratio"] >= target else "fail"
        out.append(entry)
    return out


def cpu_update_hidden(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Does the default preset's CPU update fit behind one interval of device work? It is hidden
    while it takes less than `interval` x (forward + backward + device optimizer) of a step."""
    out = []
    for batch_key in sorted(bench):
        for name in ("default-host", "default-device"):
            cfg = bench[batch_key].get(name)
            if cfg is None:
                continue
            entry: dict[str, Any] = {"config": f"{batch_key}/{name}", "cpu_update_ms": cfg["cpu_update_ms"],
                                     "device_ms_per_step": cfg["device_ms_per_step"], "interval": cfg["interval"],
                                     "budget_ms": None, "hidden": None}
            if cfg["cpu_update_ms"] is None or cfg["device_ms_per_step"] is None:
                entry["why"] = "no CPU update completed in the timed steps" if cfg["cpu_update_ms"] is None \
                    else "no device time"
            else:
                entry["budget_ms"] = cfg["interval"] * cfg["device_ms_per_step"]
                entry["hidden"] = cfg["cpu_update_ms"] <= entry["budget_ms"]
            out.append(entry)
    return out


def verdict(doc: dict[str, Any]) -> dict[str, Any]:
    """'fail' if a part failed or a target was missed; 'pass' once every part ran and every
    target passed; 'incomplete' otherwise, naming what is left."""
    parts = doc.get("parts", {})
    failed = [p for p, r in parts.items() if r["status"] not in ("passed", "skipped")]
    failed += [a["name"] for a in doc.get("acceptance", []) if a["status"] == "fail"]
    missing = [p for p in PARTS if p not in parts]
    missing += [a["name"] for a in doc.get("acceptance", []) if a["status"] == "missing"]
    result = "fail" if failed else "incomplete" if missing else "pass"
    return {"result": result, "failed": failed, "missing": missing}


def merge(doc: dict[str, Any], part: str, result: dict[str, Any], host: dict[str, Any]) -> dict[str, Any]:
    """`doc` with one part's result in (replacing that part's earlier one) and the derived figures
    recomputed from everything it holds."""
    doc = {**doc, "parts": dict(doc.get("parts", {})), "bench": dict(doc.get("bench", {}))}
    doc["parts"][part] = {**{k: v for k, v in result.items() if k != "section"}, "finished": stamp(),
                          "machine": host}
    if part == "tests":
        doc["tests"] = result["section"]
    elif part == "nccl":
        doc["nccl"] = result["section"]
    else:
        batch_key = part.removeprefix("bench-")
        doc["bench"][batch_key] = result["section"].get(batch_key, {})
    doc["machine"] = host
    doc["updated"] = stamp()
    doc["acceptance"] = acceptance(doc["bench"])
    doc["cpu_update_hidden"] = cpu_update_hidden(doc["bench"])
    doc["verdict"] = verdict(doc)
    # The summary first, for a person opening the file; whatever else it held after.
    order = ("commit", "updated", "verdict", "acceptance", "cpu_update_hidden", "machine", "tests", "nccl",
             "bench", "parts")
    return {**{k: doc[k] for k in order if k in doc}, **doc}


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
    cmd = [ctx.py, "-m", "zfctl", "finetune", "tiny-llama", "--data", "alpaca-sample", "--nproc", "2",
           "--max-steps", str(NCCL_STEPS), "--set", "train.device=cuda", "--set", "distributed.backend=nccl",
           "--output", str(raw / "run"), "--force"]
    code, secs = run_logged(cmd, raw / "finetune.log", timeout=ctx.timeout, env=ctx.env)
    section = nccl_summary(raw / "run" / "metrics.jsonl", code, NCCL_STEPS)
    return {"status": section["status"], "seconds": round(secs, 1), "log": str(raw / "finetune.log"),
            "section": section}


def run_part(ctx: Context, part: str) -> dict[str, Any]:
    if part == "tests":
        return part_tests(ctx)
    if part == "nccl":
        return part_nccl(ctx)
    return part_bench(ctx, int(part.removeprefix("bench-b")))


# -- main ----------------------------------------------------------------------------------------------

def summary_lines(doc: dict[str, Any]) -> list[str]:
    lines = [f"{p}: {r['status']} ({r.get('seconds', 0):.0f} s)" + (f", {r['reason']}" if r.get("reason") else "")
             for p, r in doc["parts"].items()]
    t = doc.get("tests")
    if t and "passed" in t:
        lines.append(f"tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
                     f"{t['skipped']} skipped" + (f"; failing: {', '.join(t['failing'])}" if t["failing"] else ""))
    for a in doc["acceptance"]:
        got = "missing" if a["ratio"] is None else f"{a['ratio']:.2f}"
        lines.append(f"{a['name']} ({a['config']} vs {a['baseline']}): {got}, target >= {a['target']:g}: {a['status']}")
    for h in doc["cpu_update_hidden"]:
        if h["hidden"] is not None:
            lines.append(f"{h['config']}: CPU update {h['cpu_update_ms']:.0f} ms vs {h['interval']} x "
                         f"{h['device_ms_per_step']:.0f} ms of device work: {'hidden' if h['hidden'] else 'NOT hidden'}")
    v = doc["verdict"]
    lines.append(f"verdict: {v['result']}" + (f"; failed: {', '.join(v['failed'])}" if v["failed"] else "")
                 + (f"; not yet: {', '.join(v['missing'])}" if v["missing"] else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", metavar="PART", help="tests, bench-b1, bench-b4, nccl or all (default)")
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
