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

from zfctl.offload.device import pinned

# The budget rule itself (rate x window, clamped: ``inflight_bytes``) is arithmetic the plan applies
# too, so it lives in sizing.py, which imports no torch.
PROBE_BYTES = 64 * 2**20  # long enough that launch overhead (~10 us) is under 1% at 50 GB/s


def measure_d2h_gbps(device: torch.device, nbytes: int = PROBE_BYTES) -> float | None:
    """One pinned device -> host copy of ``nbytes``, timed with CUDA events; None off CUDA.

    A sync point, once per optimizer construction (~1-2 ms plus the allocation). The first copy
    warms the path (driver mapping of the pinned page), the second is timed.
    """
    return _measure(device, nbytes, to_host=True)


def measure_h2d_gbps(device: torch.device, nbytes: int = PROBE_BYTES) -> float | None:
    """The same probe host -> device (the install's direction; `zfctl bench` prints both)."""
    return _measure(device, nbytes, to_host=False)


def _measure(device: torch.device, nbytes: int, *, to_host: bool) -> float | None:
    if device.type != "cuda":
        return None
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    # Page-locked at its exact size and unpinned again below (the caching host allocator would keep
    # the block pinned for the life of the process).
    host = pinned.empty(nbytes, torch.uint8, pin=True, device=device)
    src, dst = (dev, host) if to_host else (host, dev)
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
    pinned.release(host)
    return nbytes / (ms * 1e6) if ms > 0 else None
