"""The transfer scheduler: a ring of device slots for the installs, and the step's scalar fetch,
each ring with its own CUDA stream and events.

Large tensors move as slot-sized chunks, so the memory a transfer holds stays bounded
(``slots x slot_bytes``) and copies and device compute overlap. Every copy goes through
``pcie.copy_async`` (a wait for the producer, the copy, an event after it). Gradients do not go
through a ring: each step's land in the step's slot (stream.py, slots.py); the D2H ring only
``fetch``es the step's scalars, and its slot size cuts the chunks (chunks.py).

H2D (updated params, an install): the sources are ranges of the install source (the upload
buffer the CPU AdamW writes in the model dtype, or the fp32 master: host.py), copied by
the ring's stream straight into device slot i (no host copy: the main thread only enqueues); the
install stream (install.py) waits for that copy, ``deliver(slot)`` scatters it into the params,
and an event after the scatter frees the device slot for chunk i + slots: a device-side wait of
the copy stream, so the host never blocks. The device slots are allocated on the copy stream,
their first writer, so the caching allocator never hands them a block another stream may still
be reading. When the source is page-locked (CUDA, ``pin_memory``) the copy is a DMA that reads
it after the call returned: the event after the last copy is the install's fence, and the source
may not be written (by the next CPU update, a load) nor unpinned (``close()``) before it fired
(``HostState.install_fence``).
Page-locked means registered in pinned.py's registry (``pinned.holds``, by address range), never
``is_pinned()``, which answers for the storage's unaligned base outside the registered pages and
says False. From pageable memory (``pin_memory: false``) CUDA stages the source before the copy
call returns, so there is no fence.

Without CUDA the same code runs synchronously: ``deliver`` reads straight from the install
source. That is how CI exercises this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zfctl.offload.device import pinned
from zfctl.offload.device.pcie import copy_async, host_wait
from zfctl.offload.ledger import NOWHERE, Ledger


class Ring:
    """``nslots`` device slots of ``slot_bytes`` each (made at the first install), one copy stream
    and one event per slot; ``fetch`` uses the stream alone."""

    ledger: Ledger = NOWHERE  # where its bytes and waits are counted (ledger.py; the optimizer's own)

    def __init__(self, device: torch.device, nslots: int, slot_bytes: int, pin_memory: bool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.nslots = nslots
        self.slot_bytes = slot_bytes
        self.pin = pin_memory and self.cuda
        self._device: torch.Tensor | None = None  # device slots of the H2D direction, made on first use
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._freed: list[Any] = [None] * nslots  # per device slot: the scatter that last read it

    def h2d(self, chunks: Iterable[tuple[torch.Tensor, Any]], deliver: Callable[[torch.Tensor, Any], None], *,
            stream: Any = None) -> tuple[int, Any]:
        """Stream ``(host_src, tag)`` chunks to the device; ``deliver(device_tensor, tag)`` each.

        ``deliver`` runs on the host but only enqueues work on ``stream`` (the install stream,
        install.py; None: the current stream), which waits for that chunk's copy first. Returns
        (bytes copied, the event after the last copy that reads a page-locked source: None when
        every source was read before this returned).
        """
        total = 0
        reader = (stream if stream is not None else torch.cuda.current_stream(self.device)) if self.cuda else None
        last = None
        for n, (src, tag) in enumerate(chunks):
            i = n % self.nslots
            nbytes = src.numel() * src.element_size()
            total += nbytes
            self.ledger.moved("h2d.install", nbytes)  # PCIe H2D (CPU: what would cross it) ...
            self.ledger.moved("host.install", nbytes)  # ... read from the host source
            if not self.cuda:
                deliver(src, tag)  # the same memory: a synchronous host copy in ``deliver``
                continue
            assert self.stream is not None and reader is not None  # CUDA: both exist
            dev = self._device_slot(i, src.numel(), src.dtype, reader)
            # Device slot i is rewritten only after the scatter that last read it: a device-side
            # wait of the copy stream (the host never blocks here). A page-locked source is a DMA
            # that reads it later (the fence); a pageable one is staged by CUDA in the call.
            copied = copy_async(self.stream, dev, src, after=self._freed[i])  # PCIe H2D: the install source's columns
            if pinned.holds(src):  # a DMA reading the source after this returns: the fence
                last = copied
            reader.wait_event(copied)  # device-side: the scatter comes after this chunk's copy
            with torch.cuda.stream(reader):
                deliver(dev, tag)  # scatter into the params
                freed = torch.cuda.Event()
                freed.record(reader)
            self._freed[i] = freed
        return total, last

    def _device_slot(self, i: int, numel: int, dtype: torch.dtype, reader: Any) -> torch.Tensor:
        per = self.slot_bytes // dtype.itemsize
        if numel > per:
            raise ValueError(f"chunk of {numel * dtype.itemsize} B exceeds the ring slot size of {self.slot_bytes} B")
        if self._device is None:
            # Allocated on the copy stream, which writes it first: a block from the compute
            # stream's pool could still be read by compute kernels queued before this install.
            with torch.cuda.stream(self.stream):
                self._device = torch.empty(self.nslots * self.slot_bytes, dtype=torch.uint8, device=self.device)
            self._device.record_stream(reader)  # the scatters read it: freeing waits for them too
        return self._device[i * self.slot_bytes : i * self.slot_bytes + numel * dtype.itemsize].view(dtype)

    def fetch(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start copying a small device tensor to the host now; the returned call waits and gives it.

        The copy is ordered after the compute work enqueued so far, not after what the caller
        enqueues next, so the device update can be launched before the host waits for the scalars.
        """
        self.ledger.moved("d2h.scalars", t.numel() * t.element_size())
        if not self.cuda:
            return lambda: t
        assert self.stream is not None  # CUDA: created in __init__
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)  # a few bytes (caching allocator)
        event = copy_async(self.stream, host, t, after=torch.cuda.current_stream(self.device))  # PCIe D2H: scalars
        t.record_stream(self.stream)

        ledger = self.ledger

        def result() -> torch.Tensor:
            host_wait(ledger, "host.scalars", event)  # sync point: only the work enqueued before fetch()
            return host

        return result
