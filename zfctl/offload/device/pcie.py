"""Every asynchronous PCIe copy the engine enqueues goes through :func:`copy_async`.

Device to host (gradients, the device path's interval sum) and host to device (installed params)
copies run on side streams so that they overlap compute. Each one needs the same three things,
written once here: the copy stream first waits for whatever produced the source (a stream or an
event: a device-side wait, the host does not block), the copy is enqueued ``non_blocking`` (a DMA
when the host side is page-locked, see pinned.py), and an event is recorded after it, which is
what every reader of the destination waits for. Who waits for which event is written next to
each call site (stream.py, ring.py, device_acc.py) and in docs/design.md, "Threads and buffer
ownership".

Test hook: :func:`delay_copies` makes every copy stream spin for a number of GPU cycles before
each copy (``torch.cuda._sleep``), so that a reader that forgot its wait reads the destination
before the copy lands and the race stress tests (tests/gpu) see wrong bits instead of passing by
luck: tiny test tensors otherwise copy in microseconds.

Waits and bytes are counted where they happen (ledger.py): :func:`host_wait` and
:func:`device_wait` wait and count in one call, so a wait written through them is in the step's
``StepStats.waits``.

The helper thread (the CPU worker) waits for copy events. A new thread's
current CUDA device is device 0, and its first CUDA call there would create a context on GPU 0
(~0.5 GB) in every rank of a multi-GPU job: :func:`bind_device` is its first call.
"""

from __future__ import annotations

from typing import Any

import torch

_delay_cycles = 0


def delay_copies(cycles: int) -> None:
    """Tests only: spin each copy stream ``cycles`` GPU cycles before every copy (0: off)."""
    global _delay_cycles
    _delay_cycles = int(cycles)


def copy_async(stream: Any, dst: torch.Tensor, src: torch.Tensor, *, after: Any) -> Any:
    """Enqueue ``dst.copy_(src)`` on ``stream`` once ``after`` (a stream, or an event, or None) has
    finished what it had enqueued so far; returns the event recorded after the copy.

    The caller owns keeping ``src`` alive until the event (``record_stream`` for device memory
    from the caching allocator) and waiting for it before ``dst`` is read.
    """
    if isinstance(after, torch.cuda.Stream):
        stream.wait_stream(after)
    elif after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        if _delay_cycles:
            torch.cuda._sleep(_delay_cycles)
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def bind_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def timed_wait(stream: Any, event: Any) -> tuple[Any, Any]:
    """``stream.wait_event(event)`` between two timing events: the time between them is how long
    ``stream`` sat idle waiting for a copy (a device-side stall, read later without a sync)."""
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record(stream)
    stream.wait_event(event)
    after.record(stream)
    return before, after


def host_wait(ledger: Any, kind: str, event: Any) -> None:
    """The calling thread blocks until ``event`` fired (``event.synchronize()``), counted as one
    wait of ``kind`` (ledger.py ``WAIT_KINDS``)."""
    with ledger.waiting(kind):
        event.synchronize()


def device_wait(ledger: Any, kind: str, stream: Any, event: Any) -> tuple[Any, Any]:
    """:func:`timed_wait` (``stream`` waits on the device for ``event``), counted as one wait of
    ``kind``: the compute stream idle until a copy landed, a wait that can stop the GPU."""
    ledger.waited(kind)
    return timed_wait(stream, event)


def waited_ms(pairs: list[tuple[Any, Any]]) -> float:
    """Total device idle time of :func:`timed_wait` pairs (their events must have fired)."""
    total = 0.0
    for before, after in pairs:
        after.synchronize()  # long fired when read a step later; a sync only if read early
        total += before.elapsed_time(after)
    return total


def count_waits(stats: Any, pairs: list[tuple[Any, Any]], kind: str | None = None) -> None:
    """Add the device-side waits of one step (the compute stream idle until a copy landed,
    :func:`timed_wait`) to its ``StepStats``: to ``device_wait_ms`` and to the stall (and to
    ``wait_ms[kind]``, the waits :func:`device_wait` counted), read one step late like the device
    timings (``StepStats.defer``), so no sync now."""
    if not pairs:
        return
    pairs = list(pairs)

    def read(st: Any) -> None:
        ms = waited_ms(pairs)
        st.device_wait_ms += ms
        st.stall_ms += ms
        if kind is not None:
            st.tab.waited(kind, n=0, ms=ms)

    stats.defer(read)
