"""How many gradient bytes may be in flight to the host: sized from a measured D2H bandwidth.

The host paths (stream.py) keep device temporaries of the host-owned gradient columns alive until
their copy into the step's page-locked gradient slot has finished. Too few bytes in flight and a hook waits
for PCIe (stall inside backward); too many and the temporaries cost device memory for nothing.
The right amount is what the link drains in a short window: at 55 GB/s (the raw pinned D2H
measured in docs/design.md, "Performance model") 2 ms is 110 MB, a few layers' matrices of a
1B model. So the budget is ``rate x window``, clamped, and the rate is measured once per
optimizer, not assumed.
"""

from __future__ import annotations

import torch

from zfctl.offload import pinned

PROBE_BYTES = 64 * 2**20  # long enough that launch overhead (~10 us) is under 1% at 50 GB/s
WINDOW_MS = 2.0  # copy time the in-flight bytes should cover
MIN_BYTES = 16 * 2**20  # below this a hook waits on nearly every large matrix
MAX_BYTES = 1024 * 2**20  # device memory held by temporaries, whatever the link


def inflight_bytes(gbps: float, *, window_ms: float = WINDOW_MS, lo: int = MIN_BYTES,
                   hi: int = MAX_BYTES) -> int:
    """Bytes that ``window_ms`` of copy at ``gbps`` (1e9 B/s) moves, clamped to ``[lo, hi]``.

    A pure function of its arguments; a non-positive or non-finite rate gives ``lo``.
    """
    if lo > hi:
        raise ValueError(f"inflight_bytes: lo ({lo}) > hi ({hi})")
    if not gbps > 0 or gbps == float("inf"):
        return lo
    return int(min(hi, max(lo, gbps * 1e9 * window_ms / 1e3)))


def measure_d2h_gbps(device: torch.device, nbytes: int = PROBE_BYTES) -> float | None:
    """One pinned device -> host copy of ``nbytes``, timed with CUDA events; None off CUDA.

    A sync point, once per optimizer construction (~1-2 ms plus the allocation). The first copy
    warms the path (driver mapping of the pinned page), the second is timed.
    """
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    # Page-locked at its exact size and unpinned again below (the caching host allocator would keep
    # the block pinned for the life of the process).
    dst = pinned.empty(nbytes, torch.uint8, pin=True, device=device)
    stream = torch.cuda.Stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    ms = start.elapsed_time(end)
    pinned.release(dst)
    return nbytes / (ms * 1e6) if ms > 0 else None
