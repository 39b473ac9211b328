"""The transfer scheduler: a ring of host slots per direction, with its own CUDA stream and events.

Large tensors move as slot-sized chunks, so pinned memory stays bounded (``slots x slot_bytes``
per ring) and copies, host work and device compute overlap: while the copy engine moves chunk
i+1, the host consumes chunk i (D2H) or fills chunk i+1 (H2D). A slot is reused only after the
event of its previous copy has fired.

D2H (gradients): ``fill(dst)`` writes a chunk on the compute stream (the optimizer transposes a
column range there, so the host receives column-major data), the ring's stream waits for the
compute stream, copies it into a pinned slot and records the slot's event; ``consume(view)``
runs on the host once that event fired (the optimizer accumulates it with the native kernel).

H2D (updated params): the host copies a chunk of the upload buffer into a free pinned slot, the
ring's stream copies it into a device temporary, and the compute stream waits for that copy
before ``deliver(tmp)`` scatters it into the params (all enqueued, nothing blocks the host).

Without CUDA the same code runs with plain memory and synchronous copies: ``fill`` writes straight
into the slot and ``deliver`` reads straight from it. That is how CI exercises this module.
``pin_memory=False`` uses pageable slots (the copies then stage through the driver and stop
overlapping), kept for the benchmark's comparison.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

Fill = Callable[[torch.Tensor], None]


class Ring:
    """``nslots`` host slots of ``slot_bytes`` each, one copy stream and one event per slot."""

    def __init__(self, device: torch.device, nslots: int, slot_bytes: int, pin_memory: bool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.nslots = nslots
        self.slot_bytes = slot_bytes
        self.pin = pin_memory and self.cuda
        self._slots: list[torch.Tensor] = []  # allocated on first use
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._events = [torch.cuda.Event() for _ in range(nslots)] if self.cuda else []

    def _slot(self, i: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A typed view of slot ``i`` for ``numel`` elements."""
        nbytes = numel * dtype.itemsize
        if nbytes > self.slot_bytes:
            raise ValueError(f"chunk of {nbytes} B exceeds the ring slot size of {self.slot_bytes} B")
        while len(self._slots) <= i:
            self._slots.append(torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin))
        return self._slots[i][:nbytes].view(dtype)

    @property
    def host_bytes(self) -> int:
        """Host memory held by the slots allocated so far."""
        return sum(s.numel() for s in self._slots)

    def d2h(self, chunks: Iterable[tuple[int, torch.dtype, Fill, Any]],
            consume: Callable[[torch.Tensor, Any], None]) -> int:
        """Stream ``(numel, dtype, fill, tag)`` chunks to the host; ``consume(view, tag)`` each, in order.

        Returns the bytes copied. The host blocks only on the event of the oldest chunk when the
        ring is full, and at the end on the last one.
        """
        total = 0
        inflight: deque[tuple[torch.Tensor, Any, Any]] = deque()
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        for n, (numel, dtype, fill, tag) in enumerate(chunks):
            i = n % self.nslots
            if len(inflight) == self.nslots:  # the oldest chunk occupies slot i: wait, consume, reuse
                view, old_tag, event = inflight.popleft()
                event.synchronize()  # sync point: that chunk's D2H copy
                consume(view, old_tag)
            view = self._slot(i, numel, dtype)
            total += view.numel() * view.element_size()
            if not self.cuda:
                fill(view)
                consume(view, tag)
                continue
            assert self.stream is not None and compute is not None  # CUDA: both exist
            tmp = torch.empty(numel, dtype=dtype, device=self.device)
            fill(tmp)  # compute stream
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                view.copy_(tmp, non_blocking=True)  # PCIe D2H of one chunk
                self._events[i].record(self.stream)
            tmp.record_stream(self.stream)  # keep tmp's memory until the copy stream is done with it
            inflight.append((view, tag, self._events[i]))
        while inflight:
            view, tag, event = inflight.popleft()
            event.synchronize()
            consume(view, tag)
        return total

    def h2d(self, chunks: Iterable[tuple[torch.Tensor, Any]],
            deliver: Callable[[torch.Tensor, Any], None]) -> int:
        """Stream ``(host_src, tag)`` chunks to the device; ``deliver(device_tensor, tag)`` each.

        ``deliver`` runs on the host but only enqueues work on the compute stream, which waits for
        that chunk's copy first. The host waits only for a slot's previous copy before refilling
        it; once this returns, every ``host_src`` has been read and may be overwritten.
        """
        total = 0
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        for n, (src, tag) in enumerate(chunks):
            i = n % self.nslots
            view = self._slot(i, src.numel(), src.dtype)
            total += view.numel() * view.element_size()
            if self.cuda:
                self._events[i].synchronize()  # sync point: the slot's previous H2D copy
            view.copy_(src.reshape(-1))  # host memcpy into the (pinned) slot
            if not self.cuda:
                deliver(view, tag)
                continue
            assert self.stream is not None and compute is not None  # CUDA: both exist
            with torch.cuda.stream(self.stream):
                tmp = torch.empty(view.numel(), dtype=view.dtype, device=self.device)
                tmp.copy_(view, non_blocking=True)  # PCIe H2D of one chunk
                self._events[i].record(self.stream)
            compute.wait_event(self._events[i])
            tmp.record_stream(compute)
            deliver(tmp, tag)
        return total

    def fetch(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start copying a small device tensor to the host now; the returned call waits and gives it.

        The copy is ordered after the compute work enqueued so far, not after what the caller
        enqueues next, so the device update can be launched before the host waits for the scalars.
        """
        if not self.cuda:
            return lambda: t
        assert self.stream is not None  # CUDA: created in __init__
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)  # PCIe D2H: a few scalars
            event = torch.cuda.Event()
            event.record(self.stream)
        t.record_stream(self.stream)

        def result() -> torch.Tensor:
            event.synchronize()  # sync point: only the work enqueued before fetch()
            return host

        return result
