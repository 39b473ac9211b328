"""From the GPU check's raw outputs to its JSON (scripts/gpu_check.py runs the parts): the
figures of each bench configuration, the acceptance ratios, the CPU-update hiding check, the
verdict, and merging one part into the file the earlier parts wrote. Standard library only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gpu_common import stamp

PARTS = ("tests", "bench-b1", "bench-b4", "nccl", "fit-24gb")
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
# Each gradient path's mean step within this factor of the bound its bytes set on the measured
# machine (zfctl/bench/bound.py: the slowest of device compute, PCIe each way, host memory).
BOUND_PATHS = ("default-host", "default-device")
BOUND_BATCHES = (1, 4)
BOUND_TARGET = 1.3
# A selection step (it re-chooses the device's columns and migrates their state) at most this
# many times an ordinary step of the same path (docs/design.md, "Performance model": no selection that stops the GPU).
SELECTION_TARGET = 2.0


# -- from `zfctl bench --json` files to figures -------------------------------------------------------

def _mean(agg: dict | None) -> float | None:
    return agg.get("mean") if isinstance(agg, dict) else None


def figures(row: dict[str, Any], meta: dict[str, Any], source: str) -> dict[str, Any]:
    """The numbers the check reports for one bench row (None where the bench had none)."""
    ms = row["step_ms"]["overall"]
    phases = [_mean(row.get(k)) for k in ("fwd_ms", "bwd_ms", "device_opt_ms")]
    d2h = row.get("d2h_bytes_per_step")
    bound = row.get("bound") or {}
    records = row.get("records") or []
    selecting = [r["step_ms"] for r in records if r.get("selection")]
    plain = sorted(r["step_ms"] for r in records if not r.get("selection") and not r.get("update"))
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
        # what the bench printed: the bound its ledger's bytes set, measured / bound, the resource
        # that sets it, and the gap's parts (ms per step)
        "bound_ms": bound.get("bound_ms"),
        "bound_ratio": bound.get("ratio"),
        "bound_limit": bound.get("limit"),
        "bound_gap_ms": bound.get("gap_ms"),
        "bound_terms_ms": bound.get("terms_ms"),
        "bound_device_source": bound.get("device_source"),  # "off": the file's own `off` row; "own"
        "passes_ms": None if None in phases[:2] else phases[0] + phases[1],  # forward + backward
        "device_opt_ms": phases[2],
        "link_gbps": {"d2h": meta.get("d2h_gbps"), "h2d": meta.get("h2d_gbps"), "host": meta.get("host_gbps")},
        "peak_host_rss_bytes": row.get("peak_host_rss_bytes"),
        "peak_device_allocated_bytes": row.get("peak_device_allocated_bytes"),
        "peak_device_reserved_bytes": row.get("peak_device_reserved_bytes"),
        # the timed selection steps' mean, and the median of the steps that neither select nor
        # end an interval (what a selection step is held against: ``selection_cost``)
        "selection_step_ms": sum(selecting) / len(selecting) if selecting else None,
        "selection_steps": len(selecting),
        "ordinary_step_ms": plain[len(plain) // 2] if plain else None,
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


def path_bound(cfg: dict[str, Any], off: dict[str, Any] | None) -> tuple[float, str, str]:
    """(bound ms, limiting resource, where device compute came from) of one path's figures.

    scripts/bench_zenflow_gpu.sh runs `off` once per batch, beside `paper`, so the other presets'
    files printed a bound whose device compute is their own forward + backward (a backward the
    hooks may have slowed). Where the batch has an `off` row, the device term is rebuilt as
    zfctl/bench/bound.py builds it when `off` is in the same run: `off`'s forward + backward plus
    the path's own device optimizer; the bound is again the slowest resource."""
    terms = dict(cfg.get("bound_terms_ms") or {})
    if cfg.get("bound_device_source") == "own" and off is not None and off.get("passes_ms") is not None \
            and cfg.get("device_opt_ms") is not None:
        terms["device"] = off["passes_ms"] + cfg["device_opt_ms"]
        known = {k: v for k, v in terms.items() if v is not None}
        limit = max(known, key=lambda k: known[k])
        return known[limit], limit, "off row of this batch"
    return cfg["bound_ms"], cfg["bound_limit"], "the bench's"


def within_bound(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Each gradient path at each batch: measured / bound <= BOUND_TARGET (pass / fail / missing)."""
    out = []
    for batch in BOUND_BATCHES:
        for path in BOUND_PATHS:
            cfg, why = _usable(bench, batch, path)
            entry: dict[str, Any] = {"name": f"{path} within {BOUND_TARGET:g}x of its bound at batch {batch}",
                                     "config": f"b{batch}/{path}", "target": BOUND_TARGET, "ratio": None}
            if cfg is not None and not cfg.get("bound_ms"):
                why = f"b{batch}/{path}: the bench printed no bound (a zfctl before the bound, or no rates)"
            if why:
                entry.update(status="missing", why=why)
            else:
                assert cfg is not None  # _usable gave no reason
                bound_ms, limit, source = path_bound(cfg, bench.get(f"b{batch}", {}).get("off"))
                ratio = cfg["ms_per_step"]["mean"] / bound_ms
                entry.update(ratio=ratio, bound_ms=bound_ms, limit=limit, device_compute=source,
                             printed={"bound_ms": cfg["bound_ms"], "ratio": cfg["bound_ratio"]},
                             gap_ms=cfg["bound_gap_ms"], status="pass" if ratio <= BOUND_TARGET else "fail")
            out.append(entry)
    return out


def selection_cost(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Each gradient path at each batch: its selection steps' mean over its ordinary steps'
    median <= SELECTION_TARGET (pass / fail / missing: no selection step among the timed ones)."""
    out = []
    for batch in BOUND_BATCHES:
        for path in BOUND_PATHS:
            cfg, why = _usable(bench, batch, path)
            entry: dict[str, Any] = {"name": f"{path} selection step within {SELECTION_TARGET:g}x of an ordinary "
                                             f"step at batch {batch}", "config": f"b{batch}/{path}",
                                     "target": SELECTION_TARGET, "ratio": None}
            if cfg is not None and (cfg.get("selection_step_ms") is None or not cfg.get("ordinary_step_ms")):
                why = f"b{batch}/{path}: no timed selection step (or no ordinary one) in the bench's records"
            if why:
                entry.update(status="missing", why=why)
            else:
                assert cfg is not None  # _usable gave no reason
                ratio = cfg["selection_step_ms"] / cfg["ordinary_step_ms"]
                entry.update(ratio=ratio, selection_ms=cfg["selection_step_ms"], ordinary_ms=cfg["ordinary_step_ms"],
                             steps=cfg["selection_steps"], status="pass" if ratio <= SELECTION_TARGET else "fail")
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
    """'fail' if a part failed or a target was missed; 'pass' once every part ran (or was skipped
    for a reason the machine gives, e.g. the NCCL run on one GPU) and every target passed;
    'incomplete' otherwise, naming what is left. ``skipped`` names the parts that did not run, so
    a 'pass' never hides them."""
    parts = doc.get("parts", {})
    failed = [p for p, r in parts.items() if r["status"] not in ("passed", "skipped")]
    checks = [*doc.get("acceptance", []), *doc.get("within_bound", []), *doc.get("selection_cost", [])]
    failed += [a["name"] for a in checks if a["status"] == "fail"]
    missing = [p for p in PARTS if p not in parts]
    missing += [a["name"] for a in checks if a["status"] == "missing"]
    skipped = [p for p, r in parts.items() if r["status"] == "skipped"]
    result = "fail" if failed else "incomplete" if missing else "pass"
    return {"result": result, "failed": failed, "missing": missing, "skipped": skipped}


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
    elif part == "fit-24gb":
        doc["fit_24gb"] = result["section"]
    else:
        batch_key = part.removeprefix("bench-")
        doc["bench"][batch_key] = result["section"].get(batch_key, {})
    doc["machine"] = host
    doc["updated"] = stamp()
    doc["acceptance"] = acceptance(doc["bench"])
    doc["within_bound"] = within_bound(doc["bench"])
    doc["selection_cost"] = selection_cost(doc["bench"])
    doc["cpu_update_hidden"] = cpu_update_hidden(doc["bench"])
    doc["verdict"] = verdict(doc)
    # The summary first, for a person opening the file; whatever else it held after.
    order = ("commit", "updated", "verdict", "acceptance", "within_bound", "selection_cost", "cpu_update_hidden",
             "machine", "tests", "nccl", "fit_24gb", "bench", "parts")
    return {**{k: doc[k] for k in order if k in doc}, **doc}


def _fmt_ms(agg: dict | None) -> str:
    mean = agg.get("mean") if isinstance(agg, dict) else None
    return "n/a" if mean is None else f"{mean:.0f}"


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
    for b in doc.get("within_bound", []):
        got = "missing" if b["ratio"] is None else f"{b['ratio']:.2f}x its bound of {b['bound_ms']:.0f} ms ({b['limit']})"
        lines.append(f"{b['config']}: measured / bound {got}, target <= {b['target']:g}: {b['status']}")
    for c in doc.get("selection_cost", []):
        got = "missing" if c["ratio"] is None else \
            f"{c['ratio']:.2f}x ({c['selection_ms']:.0f} ms against {c['ordinary_ms']:.0f} ms)"
        lines.append(f"{c['config']}: selection step / ordinary step {got}, target <= {c['target']:g}: {c['status']}")
    for h in doc["cpu_update_hidden"]:
        if h["hidden"] is not None:
            lines.append(f"{h['config']}: CPU update {h['cpu_update_ms']:.0f} ms vs {h['interval']} x "
                         f"{h['device_ms_per_step']:.0f} ms of device work: {'hidden' if h['hidden'] else 'NOT hidden'}")
    f = doc.get("fit_24gb")
    if f and f.get("peak_device_bytes"):
        dev, plan = f["peak_device_bytes"], f.get("plan_device_bytes")
        used = dev.get("reserved") or dev.get("allocated")
        changes = (f.get("fit") or {}).get("flags") or "no change"
        lines.append(f"fit-24gb: {f['layers']}-layer 7B on an emulated {f['emulated_gpu']} GPU, --fit: {changes}; peak "
                     f"device {used / 1e9:.2f} GB" + (f" (plan {plan / 1e9:.2f} GB)" if plan else "")
                     + f", {_fmt_ms(f.get('ms_per_step_zenflow'))} ms/step")
    v = doc["verdict"]
    lines.append(f"verdict: {v['result']}" + (f"; failed: {', '.join(v['failed'])}" if v["failed"] else "")
                 + (f"; not yet: {', '.join(v['missing'])}" if v["missing"] else "")
                 + (f"; skipped: {', '.join(v['skipped'])}" if v.get("skipped") else ""))
    return lines
