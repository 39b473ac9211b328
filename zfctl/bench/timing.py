"""Clocks for the timed loop: CUDA events on a GPU, the wall clock on CPU.

Both expose `mark()` (a point in time on the device's timeline), `elapsed_ms(a, b)` and
`resolve()`. On CUDA a mark is an event recorded on the current stream: recording costs a few
microseconds of host time and adds NO synchronisation, so the loop runs exactly as it would in
training (the host may run ahead of the GPU; events still time the GPU's own timeline, and any
time the GPU sits idle waiting for the host, e.g. while `step()` waits for the CPU worker, falls
between two events and is counted). `resolve()` is the one synchronisation per timed window; it
must run before any `elapsed_ms`.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class Clock(Protocol):
    name: str

    def mark(self) -> Any: ...

    def resolve(self) -> None: ...

    def elapsed_ms(self, a: Any, b: Any) -> float: ...


class WallClock:
    """perf_counter marks: on CPU every op is synchronous, so wall time is the step time."""

    name = "wall clock"

    def mark(self) -> float:
        return time.perf_counter()

    def resolve(self) -> None:
        pass

    def elapsed_ms(self, a: float, b: float) -> float:
        return (b - a) * 1e3


class CudaEventClock:
    """CUDA events with timing enabled, recorded on the current stream of `device`."""

    name = "CUDA events"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def resolve(self) -> None:
        # SYNC: the only one per timed window. Waits for every recorded event to complete so that
        # elapsed_time() is defined; it also drains any work the optimizer left queued.
        torch.cuda.synchronize(self.device)

    def elapsed_ms(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        return float(a.elapsed_time(b))


def clock_for(device: torch.device) -> Clock:
    return CudaEventClock(device) if device.type == "cuda" else WallClock()


def device_sync(device: torch.device) -> None:
    """Drain the device before a window starts, so the window does not pay for earlier work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: outside the timed window
