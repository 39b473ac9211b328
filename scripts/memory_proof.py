#!/usr/bin/env python3
"""Does a real run take the memory `zfctl plan` promises? Measured on CPU, checkpoints included.

    python scripts/memory_proof.py [--layers 12] [--hidden 1024] [--intermediate 2816] [--set K=V] [--json OUT]

Two runs of the embedded tiny-llama widened to ``--hidden``/``--intermediate`` (fp32, CPU, the
ZenFlow `default` preset with ``full_warm_up_rounds=0``): one with ``--layers`` layers (about 160M
parameters by default), one with 1 layer. Each run is `zfctl finetune` to step 6 (a checkpoint
is written at the end) and then `zfctl resume` to step 9 (it loads that checkpoint, trains, and
writes another). The peak RSS of every process is its own ``VmHWM`` (every page it ever had
resident at once), read when it exits (``peak_rss`` says why not ``ru_maxrss``).

On CPU the plan's device lines live in host RAM too, so the plan's figure is its host total plus
its device total. Two checks, for the finetune process (a save at its end) and the resume process
(a load, training, a save):

- the slope: what does not grow with the model (Python, torch, the tokenizer, the data) cancels
  in the difference of the two runs, so the peak RSS difference must equal the plan's difference
  within 10% (``TOLERANCE``);
- the absolute peak: each run's peak RSS must equal the plan's total within 5%
  (``ABSOLUTE_TOLERANCE``), for both sizes. The plan counts the process itself as its ``process
  baseline`` line (zfctl/plan/lines.py ``PROCESS_BASELINE``, 0.45 GB without CUDA, a constant),
  so this is what says a line is missing or the baseline is wrong: at the test's sizes (13.4M
  and 48.8M parameters) the baseline is 45% and 20% of the total.

Also reported: the slope, bytes per parameter, measured and planned. Exit code 0 when both
processes pass both checks, 1 otherwise. Takes 2-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS, RESUME_TO = 6, 9
TOLERANCE = 0.10  # the slope: the peak RSS difference of two sizes against the plan's difference
ABSOLUTE_TOLERANCE = 0.05  # each run's peak RSS against the plan's total (its process baseline included)


def model_flags(layers: int, hidden: int, intermediate: int, extra: list[str] = ()) -> list[str]:
    """--set flags for tiny-llama at this size, fp32 on CPU, default ZenFlow without warm-up
    (``extra``: more KEY=VALUE settings, e.g. zenflow.accumulate=device)."""
    sets = [f"model.config.num_hidden_layers={layers}", f"model.config.hidden_size={hidden}",
            f"model.config.intermediate_size={intermediate}", "model.config.num_attention_heads=8",
            "model.config.num_key_value_heads=8", "train.precision=fp32", "train.device=cpu",
            "train.micro_batch_size=2", "data.max_length=64", "data.end_idx=200", "train.eval_every=0",
            "train.eval_batches=1", "zenflow.full_warm_up_rounds=0", "checkpoint.keep_last=2",
            "logging.every=100", *extra]
    return [a for s in sets for a in ("--set", s)]


def peak_rss(args: list[str], env: dict[str, str], stats: Path) -> int:
    """Run ``zfctl ARGS`` to completion; its peak resident set in bytes (raises if it failed).

    Read by the process itself when it exits (``VmHWM`` of its own address space, through
    scripts/zf_memstats.py), not from ``wait4``'s ``ru_maxrss``: Linux carries the maxrss of the
    address space a process replaced at ``exec`` over into the new program's, and a subprocess
    starts as a copy of its parent, so ``ru_maxrss`` never reads below the parent's own RSS (a
    pytest process 1.2 GB into a suite made a 1.07 GB run read 1.218 GB).
    """
    cmd = [sys.executable, str(Path(__file__).with_name("zf_memstats.py")), str(stats), *args]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    return int(json.loads(stats.read_text())["vm_hwm_bytes"])


def measure(layers: int, hidden: int, intermediate: int, work: Path, extra: list[str] = ()) -> dict:
    """Plan and peak RSS of one model size: finetune (with a save) and resume (load, train, save)."""
    py = [sys.executable, "-m", "zfctl"]
    flags = model_flags(layers, hidden, intermediate, extra)
    env = {**os.environ, "COLUMNS": "200"}
    plan = json.loads(subprocess.run([*py, "plan", "tiny-llama", "--data", "alpaca-sample", *flags, "--json"],
                                     env=env, capture_output=True, text=True, check=True).stdout)
    mem = plan["memory"]
    out = work / f"run-{layers}"
    finetune = peak_rss(["finetune", "tiny-llama", "--data", "alpaca-sample", *flags, "--output", str(out),
                         "--max-steps", str(STEPS), "--force"], env, work / f"finetune-{layers}.json")
    resume = peak_rss(["resume", str(out), "--max-steps", str(RESUME_TO)], env, work / f"resume-{layers}.json")
    # A resume inside an interval under slots holds that interval's fp32 sum as a carry until its
    # update: transient, not a line (zfctl/plan/layouts.py resume_note), so the resume's plan adds it.
    return {"layers": layers, "params": mem["size"]["params"], "plan_bytes": mem["host_total"] + mem["device_total"],
            "resume_carry": mem.get("resume_carry", 0.0),
            "plan_items": {i["name"]: i["bytes"] for i in mem["items"]},
            "peak_rss_finetune": finetune, "peak_rss_resume": resume}


def compare(big: dict, small: dict) -> dict:
    """The differences of two measured sizes, the slopes, and whether they are within TOLERANCE;
    each run's peak against the plan's total, and whether it is within ABSOLUTE_TOLERANCE. Where
    the plan's notes add a transient (``_transient``), the measured figure may lie anywhere from
    the plan's total to the total with it, each end widened by the tolerance."""
    dp = big["params"] - small["params"]
    plan = big["plan_bytes"] - small["plan_bytes"]
    out = {"params_difference": dp, "plan_difference": plan, "plan_bytes_per_param": plan / dp, "tolerance": TOLERANCE,
           "absolute_tolerance": ABSOLUTE_TOLERANCE}
    ok = True
    for proc in ("finetune", "resume"):
        measured = big[f"peak_rss_{proc}"] - small[f"peak_rss_{proc}"]
        upper = plan + _transient(big, proc) - _transient(small, proc)
        out[proc] = {"measured_difference": measured, "bytes_per_param": measured / dp,
                     "measured_over_plan": measured / plan, "measured_over_plan_with_transient": measured / upper,
                     "within_tolerance": _between(measured, plan, upper, TOLERANCE),
                     "absolute": {name: absolute(run, proc) for name, run in (("big", big), ("small", small))}}
        ok = ok and out[proc]["within_tolerance"] and all(a["within_tolerance"] for a in out[proc]["absolute"].values())
    out["ok"] = ok
    return out


def absolute(run: dict, proc: str) -> dict:
    """One run's peak RSS against the plan's total for its size (and its total with the transient)."""
    plan, upper = run["plan_bytes"], run["plan_bytes"] + _transient(run, proc)
    peak = run[f"peak_rss_{proc}"]
    return {"peak_rss": peak, "plan_bytes": plan, "plan_bytes_with_transient": upper, "measured_over_plan": peak / plan,
            "within_tolerance": _between(peak, plan, upper, ABSOLUTE_TOLERANCE)}


def _between(measured: float, low: float, high: float, tolerance: float) -> bool:
    return low * (1 - tolerance) <= measured <= high * (1 + tolerance)


def _transient(run: dict, proc: str) -> float:
    """What the plan's notes add for ``proc``: a resume inside an interval under slots holds the
    interval's sum as an fp32 carry (``resume_carry``; 0 under the carry layout, whose carry is
    already a line). It is dropped at that interval's boundary, so whether it meets the peak
    (the selection's staging, made at the next selection, or a save) depends on the schedule:
    the plan's total is the lower end, the total with it the upper."""
    return run.get("resume_carry", 0.0) if proc == "resume" else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="another plan setting for both runs, e.g. zenflow.accumulate=device")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="zfctl-memory-proof-") as tmp:
        big = measure(args.layers, args.hidden, args.intermediate, Path(tmp), args.extra)
        small = measure(1, args.hidden, args.intermediate, Path(tmp), args.extra)
    result = {"big": big, "small": small, "comparison": compare(big, small)}
    c = result["comparison"]
    gb = 1e9
    print(f"{big['params'] / 1e6:.1f}M vs {small['params'] / 1e6:.1f}M params: plan difference "
          f"{c['plan_difference'] / gb:.3f} GB ({c['plan_bytes_per_param']:.2f} B/param)")
    for proc in ("finetune", "resume"):
        r = c[proc]
        print(f"  {proc:8s} peak RSS {big[f'peak_rss_{proc}'] / gb:.3f} vs {small[f'peak_rss_{proc}'] / gb:.3f} GB: "
              f"difference {r['measured_difference'] / gb:.3f} GB ({r['bytes_per_param']:.2f} B/param), "
              f"{100 * (r['measured_over_plan'] - 1):+.1f}% against the plan; absolute: " +
              ", ".join(f"{a['peak_rss'] / gb:.3f} GB against {a['plan_bytes'] / gb:.3f} GB "
                        f"({100 * (a['measured_over_plan'] - 1):+.1f}%)" for a in r["absolute"].values()))
    print("slopes within 10%, peaks within 5%" if c["ok"] else "NOT within 10% (slopes) and 5% (peaks)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if c["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
