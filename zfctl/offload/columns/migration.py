"""A selection's state migration as asynchronous DMA (one process, and each FSDP2 rank's rows).

When a selection changes a matrix's device columns (``Moves``, computed on the host from the old
and new column ids), each of its state tensors (``Pair``: device rows ``[k, width]``, host rows
``[cols, width]`` by column id) changes like this, with nothing on the training thread waiting
for the device:

* **leaving** columns (old device rows ``leave_pos``, host rows ``leave_cols``): the *out* stream
  gathers their device rows into a device temporary, packed across matrices and tensors, and
  DMAs each packed piece (at most ``STAGE_BYTES``) into the page-locked *out buffer*. The host
  rows are written later (``Departure.finish``): for the optimizer state by the CPU worker, behind
  the update in flight (``Pipeline.defer``: the update never touches these rows, the device owned
  them when it was submitted), before anything reads them: the next update (the worker's own
  FIFO), an install, ``state_dict``, a load, ``close`` (``Pipeline.settle`` waits for the job);
  for a release step's gradient (release.py ``regather_pairs``) by the main thread before the
  step's host update reads the sum (``Selector.land``; its rows go into the first pieces, so
  that wait is for them only). It waits for each piece's D2H event, and for the last install's
  DMA, which may still read the master (its rows of device-owned columns ride along in a chunk);
* **staying** columns move inside the device block (in stream: gather, then ``index_copy_``);
* **entering** columns (host rows ``enter_cols``, new device rows ``enter_dst``): the main thread
  gathers their host rows into the next slot of the page-locked *in ring* (``IN_SLOTS`` x
  ``STAGE_BYTES``; torch's ``index_select``, parallel over rows), the in stream DMAs the slot into
  a device temporary and ``index_copy_``s each part into place; the compute stream waits (on the
  device) for the in stream's last event before the step's device AdamW.

The column ids the device needs (``leave_pos``, the staying moves, ``enter_dst``) go up in one
H2D from a small page-locked buffer. Device temporaries come from the caching allocator on the
stream that uses them, so a freed one is reused in that stream's order, never while a copy reads it.

Waits: docs/design.md's waits table ("Threads and buffer ownership") lists each one with the
place it is written (``Mover.move``, ``_prepare``, ``_in_slot``, ``Departure.finish``), and
ledger.py's kinds count them (``host.migrate_ids``, ``host.migrate_slot``, ``host.migrate_out``, ``device.migrate``,
``worker.migrate``, ``host.migrate_land``).

Memory (the plan's "selection staging" line, sizing.py ``staging_bytes``): the in ring, the out
buffer (every leaving row of one selection, at most ``zenflow.tuning.staging_mb``, which the plan
sizes to what the host has to spare: the rows beyond it wait for the buffer to drain, ``_make_room``:
the main thread writes the rows already in it into the host, a ``host.migrate_out`` wait, and the
buffer is reused; the same writes the worker would make, so the same bits) and the ids buffer. Without CUDA
the same code runs synchronously on host memory (the out "DMA" is the gather itself): that is how
CI exercises it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from zfctl.offload import sizing
from zfctl.offload.columns.departure import Departure, Pair, gather_cast
from zfctl.offload.columns.selection import Moves
from zfctl.offload.device import pinned
from zfctl.offload.device.pcie import copy_async
from zfctl.offload.ledger import NOWHERE, Ledger

# The sizes are torch-free rules the plan applies too (sizing.py: STAGE_BYTES, IN_SLOTS, OUT_BYTES,
# ring_elems, out_elems, staging_bytes), read through the module at call time: a test may shrink
# sizing.STAGE_BYTES.
IN_SLOTS = sizing.IN_SLOTS


class Mover:
    """The migration's streams and page-locked buffers (made at the first selection, kept)."""

    ledger: Ledger = NOWHERE  # its bytes and the training thread's waits (ledger.py; the optimizer's own)

    def __init__(self, device: torch.device, *, pin: bool, ring: int, out: int, ids: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # Two copy streams, one per direction (PCIe is full duplex): None off CUDA.
        self.in_stream: Any = torch.cuda.Stream(device) if self.cuda else None
        self.out_stream: Any = torch.cuda.Stream(device) if self.cuda else None
        self.pin = pin and self.cuda
        self._sizes = (ring, out, ids)
        self._slot_elems = ring // IN_SLOTS
        # Made at the first selection (its first move), kept: the plan counts them from the start.
        self._ring: torch.Tensor | None = None
        self._ring_events: list[Any] = [None] * IN_SLOTS
        self._next_slot = 0
        self._out: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None
        self._ids_event: Any = None
        self._done: Any = None  # the in stream's last event of the last selection: after all its H2D
        self._out_at = 0  # elements of the out buffer this selection has filled
        self._deps: list[Departure] = []  # the departures that hold rows of the out buffer
        self.host_waits = 0  # main-thread waits for an in-ring slot or the ids buffer (tests count them)

    def release(self) -> None:
        """Wait for the last DMAs that read the page-locked buffers, then unpin them (close())."""
        if self._done is not None:
            self._done.synchronize()  # after every H2D that read the ring or the ids buffer
        for buf in (self._ring, self._ids, self._out):
            if buf is not None:
                pinned.release(buf)

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """A small device tensor on the host: one D2H after the compute stream's work so far, one
        host wait for its event (the selection's column ids: nothing can move before them)."""
        self.ledger.moved("d2h.migrate", t.numel() * t.element_size())  # (CPU: what would cross PCIe)
        if not self.cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin and torch.cuda.is_available())
        event = copy_async(self.out_stream, host, t, after=torch.cuda.current_stream(self.device))  # PCIe D2H: ids
        t.record_stream(self.out_stream)
        with self.ledger.waiting("host.migrate_ids"):
            event.synchronize()  # sync point (selection steps): the new column ids and counters
        return host

    def move(self, jobs: list[tuple[Moves, list[Pair]]], first: Departure | None = None) -> tuple[int, int]:
        """Enqueue every move of one selection (each pair's leaving rows to its ``to``, those of
        ``first`` in the first pieces); returns (D2H bytes, H2D bytes) enqueued. The out buffer
        is reused: the previous selection's departures must be finished (a boundary collected
        them since)."""
        assert not any(d.pending for d in self._deps), "the last selection's leaving rows are still in the out buffer"
        self._out_at, self._deps = 0, []
        if self._ring is None:
            n_ring, n_out, n_ids = self._sizes
            self._ring = pinned.empty(n_ring, torch.float32, pin=self.pin, device=self.device)
            self._out = pinned.empty(n_out, torch.float32, pin=self.pin, device=self.device)
            self._ids = pinned.empty(n_ids, torch.int64, pin=self.pin, device=self.device)
        jobs = [(m, pairs) for m, pairs in jobs if m.changed]
        if not jobs:
            return 0, 0
        if self._done is not None and not self._done.query():  # fired a select interval ago: no wait
            with self.ledger.waiting("host.migrate_slot"):
                self._done.synchronize()  # the last selection's H2D still reads the ring
            self.host_waits += 1
        self._ring_events, self._ids_event = [None] * IN_SLOTS, None
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            self.in_stream.wait_stream(compute)  # the last device AdamW wrote the rows these read
            self.out_stream.wait_stream(compute)
        ids, h2d = self._upload(jobs)
        read: dict[int, Any] = {}
        d2h = self._out_all(jobs, ids, read, first)
        h2d += self._in_all(jobs, ids, read)
        if self.cuda:
            assert compute is not None
            self._done = torch.cuda.Event()
            self._done.record(self.in_stream)
            compute.wait_event(self._done)  # device-side: this step's device AdamW after the migration
            self.ledger.waited("device.migrate")
        self.ledger.moved("d2h.migrate", d2h)
        self.ledger.moved("h2d.migrate", h2d)
        return d2h, h2d

    # -- the column ids ------------------------------------------------------------------------
    def _upload(self, jobs: list[tuple[Moves, list[Pair]]]) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Every job's device-side ids in one H2D (in stream); the out stream waits for it."""
        names = ("leave_pos", "stay_src", "stay_dst", "enter_dst")
        flat = torch.cat([getattr(m, n) for m, _ in jobs for n in names])
        if self.cuda:
            assert self._ids is not None
            src = self._ids[: flat.numel()]
            torch.cat([flat], out=src)  # host memory only: the page-locked source of the DMA
            self.ledger.moved("host.stage", 2 * 8 * flat.numel())  # written here, read by the DMA
            with torch.cuda.stream(self.in_stream):
                dev = torch.empty(flat.numel(), dtype=torch.int64, device=self.device)
            self._ids_event = copy_async(self.in_stream, dev, src, after=None)  # PCIe H2D: the ids
            dev.record_stream(self.out_stream)
            self.out_stream.wait_event(self._ids_event)
        else:
            dev = flat
        out, o = [], 0
        for m, _ in jobs:
            views = {}
            for n in names:
                views[n] = dev[o : o + getattr(m, n).numel()]
                o += views[n].numel()
            out.append(views)
        return out, 8 * flat.numel()

    # -- leaving: device -> out buffer -------------------------------------------------------
    def _out_all(self, jobs: list[tuple[Moves, list[Pair]]], ids: list[dict[str, torch.Tensor]],
                 read: dict[int, Any], first: Departure | None) -> int:
        """Gather, pack and DMA every leaving row; the rows of ``first``'s pairs in the first
        pieces (the ones a waiter needs soonest: a release step's gradient, ``Selector.land``)."""
        order = [(j, p) for j, (m, pairs) in enumerate(jobs) for p in pairs if p.leaves and m.leave_cols.numel()]
        order.sort(key=lambda jp: jp[1].to is not first)  # stable: matrix order within each part
        left = sum(jobs[j][0].leave_cols.numel() * p.dev.shape[1] for j, p in order)
        if left == 0:
            return 0
        moved = 0
        piece: list[tuple[Pair, torch.Tensor, int, int]] = []
        buf, fill = self._out_piece(left), 0
        for j, pair in order:
            m, pos = jobs[j][0], ids[j]["leave_pos"]
            n, w, a = m.leave_cols.numel(), pair.dev.shape[1], 0
            while a < n:
                take = min(n - a, (buf.numel() - fill) // w)
                if take == 0:
                    assert fill, "a piece holds at least one row"
                    moved += self._out_flush(buf, fill, piece)
                    left -= fill
                    piece, buf, fill = [], self._out_piece(left), 0
                    continue
                with self._on(self.out_stream):  # a device gather of the leaving rows
                    torch.index_select(pair.dev, 0, pos[a : a + take], out=buf[fill : fill + take * w].view(take, w))
                piece.append((pair, m.leave_cols[a : a + take], fill, take))
                fill, a = fill + take * w, a + take
            if self.cuda:  # the matrix's rows read so far; its last such event is the one the in stream waits for
                read[m.slot.index] = torch.cuda.Event()
                read[m.slot.index].record(self.out_stream)
        return moved + self._out_flush(buf, fill, piece)

    def _out_piece(self, left: int) -> torch.Tensor:
        """Where the next packed piece is gathered: a device temporary (CUDA) or, off CUDA, its
        place in the out buffer itself. Makes room in the out buffer first."""
        assert self._out is not None
        # At most STAGE_BYTES (at least one row: the in-ring slot holds one), what is left, the buffer.
        n = min(max(sizing.STAGE_BYTES // 4, self._slot_elems), left, self._out.numel())
        self._make_room(n)
        if not self.cuda:
            return self._out[self._out_at : self._out_at + n]
        with torch.cuda.stream(self.out_stream):
            return torch.empty(n, dtype=torch.float32, device=self.device)

    def _make_room(self, n: int) -> None:
        """Past the out buffer's cap (``zenflow.tuning.staging_mb``): the rows already in it are
        written into the host now, on the main thread (their D2H waited for: ``host.migrate_out``),
        and the buffer starts again. Those rows were device-owned while the update in flight ran,
        which never touches them, so writing them before it finishes is safe (departure.py)."""
        assert self._out is not None
        if self._out_at + n <= self._out.numel():
            return
        self.ledger.waited("host.migrate_out")  # one drain: the buffer is full
        for dep in self._deps:
            dep.finish("host.migrate_out")  # sync point: only a selection larger than the out buffer gets here
        self._out_at = 0

    def _out_flush(self, buf: torch.Tensor, fill: int, piece: list[tuple[Pair, torch.Tensor, int, int]]) -> int:
        if fill == 0:
            return 0
        assert self._out is not None
        dst = self._out[self._out_at : self._out_at + fill]
        event = None
        if self.cuda:  # PCIe D2H of one packed piece into page-locked memory
            event = copy_async(self.out_stream, dst, buf[:fill], after=None)
        for pair, cols, off, take in piece:
            if all(pair.to is not d for d in self._deps):
                self._deps.append(pair.to)
            w = pair.dev.shape[1]
            pair.to.add(pair.host, cols, dst[off : off + take * w].view(take, w), event, pair.scale, pair.mirror)
        self._out_at += fill
        self.ledger.moved("host.stage", 4 * fill)  # the DMA writes the out buffer (Departure reads it)
        return 4 * fill

    # -- entering: host -> in ring -> device ---------------------------------------------------
    def _in_all(self, jobs: list[tuple[Moves, list[Pair]]], ids: list[dict[str, torch.Tensor]],
                read: dict[int, Any]) -> int:
        left = sum(m.enter_cols.numel() * p.dev.shape[1] for m, pairs in jobs for p in pairs)
        prepared: set[int] = set()
        moved, fill = 0, 0
        piece: list[tuple[int, Pair, int, int, int]] = []
        slot = self._in_slot(left) if left else None
        for j, (m, pairs) in enumerate(jobs):
            n = m.enter_cols.numel()
            for pair in pairs if n else ():
                w, a = pair.dev.shape[1], 0
                while a < n:
                    assert slot is not None
                    take = min(n - a, (slot.numel() - fill) // w)
                    if take == 0:
                        assert fill, "a slot holds at least one row"
                        moved += self._in_flush(slot, fill, piece, jobs, ids, read, prepared)
                        left -= fill
                        piece, slot, fill = [], self._in_slot(left), 0
                        continue
                    view = slot[fill : fill + take * w].view(take, w)
                    cols = m.enter_cols[a : a + take]
                    # Host gather into the ring; a release step's gradient slot (model dtype, slots.py)
                    # is widened on the way, exactly, with no full-size temporary (departure.py).
                    gather_cast(pair.host, cols, view)
                    self.ledger.moved("host.migrate", pair.host.element_size() * view.numel())  # host rows read ...
                    self.ledger.moved("host.stage", 8 * view.numel())  # ... into the ring, which the DMA reads
                    if pair.scale != 1.0:
                        view.div_(pair.scale)  # exact: a power of two
                        self.ledger.moved("host.stage", 8 * view.numel())  # read and written in place
                    piece.append((j, pair, a, take, fill))
                    fill, a = fill + take * w, a + take
        if slot is not None:
            moved += self._in_flush(slot, fill, piece, jobs, ids, read, prepared)
        for j in range(len(jobs)):  # matrices whose columns only changed rows
            self._prepare(j, jobs, ids, read, prepared)
        if self.cuda and read:
            self.in_stream.wait_event(list(read.values())[-1])  # every leaving row gathered
        return moved

    def _in_slot(self, left: int) -> torch.Tensor:
        """The next in-ring slot, once the DMA that last read it is done (a host wait only when a
        selection brings in more than the ring holds, paced by the link)."""
        assert self._ring is not None
        i = self._next_slot
        self._next_slot = (i + 1) % IN_SLOTS
        if self._ring_events[i] is not None:
            with self.ledger.waiting("host.migrate_slot"):
                self._ring_events[i].synchronize()  # sync point: slot i's previous H2D
            self._ring_events[i] = None
            self.host_waits += 1
        return self._ring[i * self._slot_elems : i * self._slot_elems + min(self._slot_elems, left)]

    def _in_flush(self, slot: torch.Tensor, fill: int, piece: list[tuple[int, Pair, int, int, int]],
                  jobs: list[tuple[Moves, list[Pair]]], ids: list[dict[str, torch.Tensor]], read: dict[int, Any],
                  prepared: set[int]) -> int:
        if fill == 0:
            return 0
        src = slot[:fill]
        if self.cuda:
            with torch.cuda.stream(self.in_stream):
                src = torch.empty(fill, dtype=torch.float32, device=self.device)
            # PCIe H2D of one packed piece from page-locked memory; the slot is free after it.
            event = copy_async(self.in_stream, src, slot[:fill], after=None)
            self._ring_events[(self._next_slot - 1) % IN_SLOTS] = event
        for j, pair, a, take, off in piece:
            self._prepare(j, jobs, ids, read, prepared)
            w = pair.dev.shape[1]
            with self._on(self.in_stream):  # off CUDA: reads the slot before it is refilled
                pair.dev.index_copy_(0, ids[j]["enter_dst"][a : a + take], src[off : off + take * w].view(take, w))
        return 4 * fill

    def _prepare(self, j: int, jobs: list[tuple[Moves, list[Pair]]], ids: list[dict[str, torch.Tensor]],
                 read: dict[int, Any], prepared: set[int]) -> None:
        """Before the first write into matrix ``j``'s device rows: the in stream waits until its
        leaving rows were read (out stream), then its staying columns change rows."""
        if j in prepared:
            return
        prepared.add(j)
        m, pairs = jobs[j]
        if self.cuda and m.slot.index in read:
            self.in_stream.wait_event(read[m.slot.index])  # device-side: the leaving rows are gathered
        if m.stay_src.numel():
            with self._on(self.in_stream):
                for pair in pairs:
                    staying = pair.dev.index_select(0, ids[j]["stay_src"])  # before the rows are rewritten
                    pair.dev.index_copy_(0, ids[j]["stay_dst"], staying)

    def _on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()
