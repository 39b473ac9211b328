"""The bound a configuration's bytes set, beside the time it measured (docs/design.md, "Performance model").

The machine is measured once per bench (:func:`measure_machine`): the PCIe link each way (one
pinned 64 MiB copy, offload/bandwidth.py) and the host memory bandwidth the native kernels reach
at the run's thread count (one AdamW pass, 28 B per element, over buffers four times the
last-level cache). Each configuration's bytes per step come from the engine's own ledger
(``StepStats.bytes``, offload/ledger.py), averaged over its timed steps, and give the time each
resource needs per step:

    bound = max(device compute, D2H bytes / D2H rate, H2D bytes / H2D rate, host bytes / host rate)

The resources run side by side when the overlap works, so the slowest one sets the pace. Device
compute is the `off` row's forward + backward (no offload: no hook runs inside them) plus the
configuration's own device optimizer (its AdamW on the selected columns, the device path's adds);
the configuration's own forward + backward where the bench has no `off` row. On a CPU-only machine the "device"
and the host are the same cores: there the compute and the host memory work add up (and no PCIe
term exists). A measured step above its bound is the gap; :func:`gap_parts` says what it is made
of, from the steps' own timings (``StepStats.wait_ms``): the selection steps' excess over the
median ordinary step, the install (the compute stream waiting for its H2D, the host for its
DMA), the boundary's wait for the CPU update, the hooks' waits, the waits for gradient copies;
"other" is what none of them explains (launch gaps, Python, a step's own host work).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zfctl.bench.runner import StepRecord

DEFAULT_LLC = 32 * 2**20  # when sysfs does not say
PROBE_PASSES = 3  # timed passes of the host probe; the fastest counts (the others saw noise)


@dataclass
class Machine:
    """What one bench measured of its machine (GB/s = 1e9 bytes per second; None: not measured)."""

    d2h_gbps: float | None
    h2d_gbps: float | None
    host_gbps: float | None  # the native AdamW's streaming rate at ``host_threads``
    host_threads: int
    same_cores: bool  # CPU only: the "device" compute runs on the host's cores


def llc_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest cache of CPU 0 (the last level), from sysfs; ``DEFAULT_LLC`` where it is absent."""
    sizes = []
    for index in sysfs.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=DEFAULT_LLC)


def measure_host_gbps(threads: int, *, elems: int | None = None) -> float | None:
    """Host bytes per second of the native AdamW (28 B per element: the sum read, master and two
    moments read and written) on ``threads`` native threads, over buffers of ``elems`` fp32 each
    (default: 16 B per element = four times the last-level cache, so the pass streams memory).
    The fastest of ``PROBE_PASSES`` timed passes after one untimed one (page faults, the pool's
    threads); about 0.1 s on a 2-core VM. None when the native library is not built."""
    from zfctl.errors import UserError

    try:
        from zfctl import _native
    except UserError:  # not built ("run make setup"): the bound goes without the host term
        return None
    n = elems or max(llc_bytes() // 4, 1 << 20)
    before = _native.get_num_threads()
    bufs = [torch.zeros(n) for _ in range(4)]  # master, sum, exp_avg, exp_avg_sq (zeros: touched)
    try:
        _native.set_num_threads(max(1, threads))
        best = float("inf")
        for i in range(PROBE_PASSES + 1):
            t0 = time.perf_counter()
            _native.adamw_step(bufs[0], bufs[1], bufs[2], bufs[3], step=i + 1, lr=1e-3, beta1=0.9, beta2=0.999,
                               eps=1e-8, weight_decay=0.0)
            if i:
                best = min(best, time.perf_counter() - t0)
    finally:
        _native.set_num_threads(before)
    return 28 * n / best / 1e9 if best > 0 else None


def measure_machine(device: torch.device, threads: int) -> Machine:
    """The link each way (CUDA only) and the host memory rate at ``threads`` native threads
    (0: the native default, every core this process may use)."""
    from zfctl.errors import UserError
    from zfctl.offload.grads.bandwidth import measure_d2h_gbps, measure_h2d_gbps

    if threads <= 0:
        try:
            from zfctl import _native

            threads = _native.get_num_threads()
        except UserError:  # not built: measure_host_gbps says None
            threads = 1
    return Machine(measure_d2h_gbps(device), measure_h2d_gbps(device), measure_host_gbps(threads), threads,
                   same_cores=device.type != "cuda")


def bytes_per_step(records: list[StepRecord]) -> dict[str, float]:
    """Mean bytes per timed step of each ledger kind, and the totals ``d2h``, ``h2d``, ``host``."""
    if not records:
        return {}
    kinds = sorted({k for r in records for k in r.bytes})
    out = {k: sum(r.bytes.get(k, 0) for r in records) / len(records) for k in kinds}
    for side in ("d2h", "h2d", "host"):
        out[side] = sum(v for k, v in out.items() if k.startswith(f"{side}."))
    return out


def _ms(nbytes: float, gbps: float | None) -> float | None:
    """Milliseconds ``nbytes`` take at ``gbps``; 0 for no bytes, None for bytes without a rate."""
    if not nbytes:
        return 0.0
    return nbytes / (gbps * 1e6) if gbps else None


def bound(per_step: dict[str, float], device_ms: float | None, machine: Machine) -> dict[str, Any]:
    """The per-step bound of a configuration moving ``per_step`` bytes (:func:`bytes_per_step`)
    whose device compute takes ``device_ms``: each resource's time, the bound (the slowest one;
    CPU: compute + host memory, the same cores) and which resource it is. A resource with bytes
    but no measured rate (the link on CPU) is left out and named in ``unmeasured``."""
    terms: dict[str, float | None] = {
        "device": device_ms,
        "d2h": None if machine.same_cores else _ms(per_step.get("d2h", 0.0), machine.d2h_gbps),
        "h2d": None if machine.same_cores else _ms(per_step.get("h2d", 0.0), machine.h2d_gbps),
        "host": _ms(per_step.get("host", 0.0), machine.host_gbps),
    }
    known = {k: v for k, v in terms.items() if v is not None}
    if machine.same_cores and "device" in known and "host" in known:
        known = {"device + host": known.pop("device") + known.pop("host"), **known}
    limit = max(known, key=lambda k: known[k]) if known else None
    unmeasured = [k for k, v in terms.items() if v is None and (k == "device" or per_step.get(k))]
    return {"terms_ms": terms, "bound_ms": known[limit] if limit else None, "limit": limit, "unmeasured": unmeasured}


GAP_WAITS = {  # gap part -> the StepStats.wait_ms kinds it sums, at steps that do not select
    "install": ("device.install", "host.install_dma"),
    "boundary wait": ("host.cpu_update",),
    "hook wait": ("host.hook_budget", "host.slot_gate"),
    "copy wait": ("device.sum_copy", "host.slot_fill", "host.slot_drain"),
}


def gap_parts(records: list[StepRecord], measured_ms: float, bound_ms: float | None) -> dict[str, float | None]:
    """What the gap (measured - bound, ms per step) is made of, per step of the timed window:
    ``selection``: the selection steps' time above the median of the steps that neither select
    nor end an interval; then the waits of ``GAP_WAITS`` at the other steps; ``other``: the rest
    (negative when the parts overlap, e.g. a hook wait inside a backward the bound also counts)."""
    if not records:
        return {}
    n = len(records)
    plain = [r.step_ms for r in records if not r.selection and not r.update]
    selecting = [r.step_ms for r in records if r.selection]
    parts: dict[str, float | None] = {"selection": 0.0 if not selecting else None}
    if selecting and plain:  # no step to compare with: unknown, not zero
        base = statistics.median(plain)
        parts["selection"] = sum(max(0.0, ms - base) for ms in selecting) / n
    for name, kinds in GAP_WAITS.items():
        parts[name] = sum(r.wait_ms.get(k, 0.0) for r in records if not r.selection for k in kinds) / n
    if bound_ms is not None:
        parts["other"] = measured_ms - bound_ms - sum(v for v in parts.values() if v is not None)
    return parts


def _sum(row: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    vals = [row[k]["mean"] for k in keys]
    return None if None in vals else sum(vals)


def add_bounds(rows: list[dict[str, Any]], results: list[Any], machine: Machine) -> None:
    """Fill each row's ``bound`` (its bytes per step, each resource's ms, the bound, the ratio
    measured / bound and the gap's parts) from its timed steps; device compute: the forward +
    backward of the `off` row of the same recompute setting (else the row's own), plus the row's
    own device optimizer."""
    off = {bool(r.get("recompute")): _sum(r, ("fwd_ms", "bwd_ms")) for r in rows if r["name"] == "off"}
    for row, res in zip(rows, results, strict=True):
        recs = res.records
        measured = row["step_ms"]["overall"]["mean"]
        own = bool(row.get("recompute")) not in off
        passes = _sum(row, ("fwd_ms", "bwd_ms")) if own else off[bool(row.get("recompute"))]
        opt = row["device_opt_ms"]["mean"]
        device_ms = None if passes is None or opt is None else passes + opt
        per_step = bytes_per_step(recs)
        b = bound(per_step, device_ms, machine)
        ratio = measured / b["bound_ms"] if measured and b["bound_ms"] else None
        row["bound"] = {"bytes_per_step": per_step, **b, "device_source": "own" if own else "off",
                        "measured_ms": measured, "ratio": ratio,
                        "gap_ms": gap_parts(recs, measured, b["bound_ms"]) if measured else {}}
