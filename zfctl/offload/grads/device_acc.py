"""``zenflow.accumulate: device``: the interval's gradient sum lives in fp32 on the device.

Per step, the host-owned column ranges of every matrix are added into a flat fp32 device buffer
laid out exactly like the host state (column-major, ``layout``), one transpose-and-add per
matrix on the compute stream, no host sync. The sum is raw, as on the host paths (the
interval-mean rule, docs/design.md "Algorithm" step 5): each step adds ``u * g`` (``u``: the
fp16 unscale, a power of two known before the backward, or 1), and the clip factors reach the
CPU update at the boundary as their interval mean (its ``grad_scale``, cpu/phases.py). The
first step of an interval *writes* (``acc = u * g``), so the buffer is never zeroed. Once per
interval the sum of the host-owned columns crosses PCIe (fp32, 4 B per element, on a copy stream
into the page-locked host sum, slots.py, ``copy_out``): one copy per span of host-owned columns
(each chunk of ``Transfers.chunks`` cut where device-owned columns leave a gap of at least
``GAP_ELEMS``; the rows of device-owned columns in between ride along, as in every chunk), one
matrix after the other, an event per matrix. The CPU worker reads the sum as the carry of its fma
chain, as it is (native ``adamw_sum`` with no slots), matrix by matrix, each after its own copy
event (``PieceWaits``, worker.py), so the update overlaps the rest of the copy out. The host never
touches a per-step gradient; the host path's D2H (2 B per element per step for bf16) disappears.

Ownership of the device buffer across a boundary: the copy out moves it one matrix (host slot) at
a time, each with its own event; the next interval's first write into a matrix's rows waits (on
the device) only for that matrix's copy, so the compute stream never waits for the whole sum at
once (27 GB at 7B, ~0.5 s of PCIe, against a ~0.1-0.3 s step) but only for what has not landed by
the time it gets there. Those waits are timed with events and counted as stall (``stall_pairs``).
There is one host sum on this path: the optimizer collects the previous CPU update before it copies
the next sum out (pipeline.py ``submit``: collect, then ``prepare``).

Cost: 4 B of device memory per matrix element this rank holds on the host side (the rows of
device-owned columns included: the buffer keeps the host layout, so a span of columns is one
copy, about ``topk_ratio`` more than strictly needed). ``resolve`` picks this mode for
``accumulate: auto`` when that fits.

Rounding: the host path adds with one fma per element and step (the native kernel); here the first step
is exact-then-one-rounding (``copy_`` then ``mul_``, like the fma into zero) and the later steps
use ``addcmul_`` (torch's rounding, an fma on most GPUs). Same sum order, so the two modes agree
bit for bit where both fuse, else to within an ulp per step (tests/offload/test_offload_accumulate.py).
"""

from __future__ import annotations

from typing import Any

import torch

from zfctl.offload.cpu.worker import PieceWaits
from zfctl.offload.device.pcie import copy_async, device_wait
from zfctl.offload.layout import Layout, as_matrix
from zfctl.offload.ledger import NOWHERE, Ledger
from zfctl.offload.sizing import device_fits  # `accumulate: auto`'s one rule, shared with the plan

# A gap of device-owned columns at least this long splits a chunk's copy out in two (1 MiB of fp32):
# shorter gaps ride along, a copy costs more than the bytes it would skip.
GAP_ELEMS = 2**18


def resolve(choice: str, device: torch.device, nbytes: int, params: list[torch.Tensor]) -> str:
    """``host`` or ``device`` for ``zenflow.accumulate`` (``auto``: the one rule, ``device_fits``).

    The run plan resolves ``auto`` from its memory estimate before the optimizer is built
    (zfctl/plan/memory.py). A library user without a plan gets the same rule with what the
    optimizer can know when it is built: the memory allocated on the device now (the model and
    the device optimizer state, built before this) plus the gradients ``params`` will get, against
    the device's total memory. Activations are not known here; the plan's estimate counts them.
    """
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "host"
    _, total = torch.cuda.mem_get_info(device)
    committed = torch.cuda.memory_allocated(device) + sum(p.numel() * p.element_size() for p in params)
    return "device" if device_fits(committed, nbytes, total) else "host"


class DeviceAccumulator:
    """The fp32 interval sum of the host-owned columns, on the device."""

    ledger: Ledger = NOWHERE  # where its bytes and waits are counted (ledger.py; the optimizer's own)

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        self.cuda = device.type == "cuda"
        self.buf = torch.zeros(layout.host_numel, dtype=torch.float32, device=device)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        # Per host slot index: the event of its last copy out, until the next write waited for it.
        self._copied: dict[int, Any] = {}
        self._last: Any = None  # the event after the whole copy out (the CPU worker's fence)
        # The event after the last add (compute stream): what the copy out waits for. Not the
        # compute stream itself: by the time of the copy out it also holds the boundary's install
        # (compute waits for every H2D chunk), and the sum's D2H would start only after the whole
        # H2D; ordered after the adds only, the two directions overlap on the link (full duplex).
        self._added: Any = None
        self.stall_pairs: list[tuple[Any, Any]] = []  # timed device waits of the last add (pcie.timed_wait)
        self.device = device

    def add(self, grads: list[torch.Tensor | None], coef: torch.Tensor | None, *, first: bool) -> None:
        """``buf (=|+=) coef * grad`` over every host slot's owned columns (compute stream, no sync).
        ``coef``: the step's unscale ``u`` as a 0-dim device tensor (fp16), or None for 1: the raw
        sum of the interval-mean rule, whose clip factors come at the boundary. ``u`` is a power of
        two, so ``u * g`` is exact and the adds below round as the host's fma chain does."""
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        self.stall_pairs = []
        for slot in self.layout.host_slots:
            if slot.host_numel == 0:
                continue
            copied = self._copied.pop(slot.index, None)
            if copied is not None:  # this slot's rows are still being copied out: wait for them only
                self.stall_pairs.append(device_wait(self.ledger, "device.sum_copy", compute, copied))  # device-side
            view = slot.host_view(self.buf)
            g = grads[slot.index]
            if g is None:  # a missing gradient counts as zero
                if first:
                    view.zero_()
                continue
            gt = as_matrix(g, slot)[:, slot.host_c0 : slot.host_c1].t()
            if first:
                view.copy_(gt)  # exact widening to fp32 ...
                if coef is not None:
                    view.mul_(coef)  # ... then one rounding, as the fma into a zero accumulator
            elif coef is not None:
                view.addcmul_(gt, coef)
            else:
                view.add_(gt)
        if self.cuda:
            self._added = torch.cuda.Event()
            self._added.record(compute)

    def copy_out(self, dst: torch.Tensor, chunks: list[Any]) -> PieceWaits | None:
        """Start the PCIe D2H of the interval sum's host-owned columns into ``dst`` (the page-locked
        host sum), one span of columns at a time (``chunks``: ``Transfers.chunks``, matrix by
        matrix, in column order); returns each matrix's wait for the CPU worker, in copy order
        (None: already done, CPU). The bytes are the spans' (ledger.py ``d2h.sum``)."""
        spans = copy_spans(chunks)
        nbytes = 4 * sum(n for _, spans_of in spans for _, n in spans_of)
        self.ledger.moved("d2h.sum", nbytes)  # PCIe D2H (CPU: what would cross it) ...
        self.ledger.moved("host.land", nbytes)  # ... written into the page-locked host sum (the carry)
        if not self.cuda:
            for _, spans_of in spans:
                for off, n in spans_of:
                    dst[off : off + n].copy_(self.buf[off : off + n])
            return None
        assert self.copy_stream is not None  # CUDA: created in __init__
        # The first copy: after this interval's last add, not after the install enqueued since
        # (the worker waits for the install's own fence, pipeline.py ``_install_wait``).
        after: Any = self._added if self._added is not None else torch.cuda.current_stream(self.device)
        pieces = []
        for slot, spans_of in spans:
            event = None
            for off, n in spans_of:
                # PCIe D2H of one span of a matrix's sum: 4 B per element, once per interval. The
                # copies queue in order on one stream: a matrix's last event means it has landed.
                event = copy_async(self.copy_stream, dst[off : off + n], self.buf[off : off + n], after=after)
                after = None  # the copy stream is ordered after the adds already
            if event is None:
                continue
            self._copied[slot.index] = event
            self._last = event
            pieces.append((slot.host_off, slot.host_numel, event.synchronize))  # worker: this matrix landed
        return PieceWaits(tuple(pieces))

    def wait(self) -> None:
        """Host wait for a copy out still in flight (checkpoints, loading)."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None
        self._copied.clear()
        self._added = None  # a load may write the buffer next: the next copy out orders after everything


def copy_spans(chunks: list[Any]) -> list[tuple[Any, list[tuple[int, int]]]]:
    """Per matrix (in ``chunks``' order), the (offset, elements) spans the copy out moves: each
    chunk's host-owned runs, joined across gaps shorter than ``GAP_ELEMS``, and across chunk
    boundaries when nothing lies between."""
    out: list[tuple[Any, list[tuple[int, int]]]] = []
    for ch in chunks:
        runs = [(0, ch.numel)] if ch.runs is None else [(int(a), int(n)) for a, n in ch.runs.tolist()]
        if not out or out[-1][0] is not ch.slot:
            out.append((ch.slot, []))
        spans = out[-1][1]
        for a, n in runs:
            a += ch.off
            if spans and a - (spans[-1][0] + spans[-1][1]) < GAP_ELEMS:
                spans[-1] = (spans[-1][0], a + n - spans[-1][0])
            else:
                spans.append((a, n))
    return out
