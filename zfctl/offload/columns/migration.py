"""A selection's state migration as asynchronous DMA (one process, and each FSDP2 rank's rows).

The unit is a ``Group`` (groups.py): one state tensor (master, a moment, the step counters, release.py's
gradient) of one device block (layout.py ``DeviceBlock``: the device columns of one length, every
matrix of that length side by side). Its ids come in block rows from the plan (selection.py
``BlockMoves``), so each device operation covers every matrix of the block at once: per group
and direction one gather or scatter per staged piece, never one per matrix (a 1.24B Llama has
three selectable blocks; tests/offload/test_migration_counts.py holds the counts). The host side
stays per matrix (its rows are addressed by column id inside each matrix's host view).

* **leaving** columns (block rows ``leave_pos``): the main thread has the *out* stream gather
  them into a device temporary, packed across groups, and DMA each packed piece (at most
  ``STAGE_BYTES``) into the page-locked *out buffer*. The host rows are written later
  (``Departure.finish``): for the optimizer state by the CPU worker, behind the update in flight
  (``Pipeline.defer``: the update never touches these rows, the device owned them when it was
  submitted), before anything reads them: the next update (the worker's own FIFO), an install,
  ``state_dict``, a load, ``close`` (``Pipeline.settle`` waits for the job); for a release
  step's gradient (release.py ``regather_pairs``) by the main thread before the step's host
  update reads the sum (``Selector.land``; its groups go first, so that wait is for them only).
  It waits for each piece's D2H event, and for the last install's DMA, which may still read the
  master (its rows of device-owned columns ride along in a chunk);
* **staying** columns move inside the block (in stream: gather, then ``index_copy_``), in
  segments cut at matrix boundaries (a matrix's gather ends before its rows are rewritten);
* **entering** columns (block rows ``enter_dst``): ``move`` returns the *fill*, a job for the CPU
  worker (selector.py hands it to the update in flight, which runs it right after it updated
  those columns: worker.py ``hand``): it gathers their host rows into the next slot of the
  page-locked *in ring* (``IN_SLOTS`` x ``STAGE_BYTES``), has the in stream DMA the slot into a
  device temporary and ``index_copy_`` each group's part into place, and records the in
  stream's last event; the main thread gathers nothing. After the fill, ``join`` has the
  compute stream wait (on the device) for that event before the step's device AdamW.

Owners: the main thread owns the out buffer's filling, the ids buffer and both streams until
``move`` returns; from then until the fill ends the worker owns the in ring and the in stream
(the main thread waits for the fill before it touches either: ``join``, the next ``move``).

The ids the device needs (every group's leaving, staying and entering block rows) go up in one
H2D from a small page-locked buffer. Device temporaries come from the caching allocator on the
stream that uses them, so a freed one is reused in that stream's order, never while a copy reads it.

Waits: docs/design.md's waits table ("Threads and buffer ownership") lists each one with the
place it is written (``Mover.move``, ``_in_slot``, ``Departure.finish``, ``join``), and ledger.py's
kinds count them (``host.migrate_ids``, ``host.migrate_slot``, ``worker.migrate_slot``,
``host.migrate_out``, ``device.migrate``, ``worker.migrate``, ``host.migrate_land``).

Memory (the plan's "selection staging" line, sizing.py ``staging_bytes``): the in ring, the out
buffer (every leaving row of one selection, at most ``zenflow.tuning.staging_mb``, which the plan
sizes to what the host has to spare: the rows beyond it wait for the buffer to drain, ``_make_room``:
the main thread writes the rows already in it into the host, a ``host.migrate_out`` wait, and the
buffer is reused; the same writes the worker would make, so the same bits) and the ids buffer.
Device temporaries: one packed piece each way, and a staying segment (at most ``STAGE_BYTES`` or
one matrix's device rows). Without CUDA the same code runs synchronously on host memory (the out
"DMA" is the gather itself): that is how CI exercises it.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from typing import Any

import torch

from zfctl.offload import sizing
from zfctl.offload.columns.departure import Departure, gather_cast
from zfctl.offload.columns.groups import IDS, Group, GroupIds, group_ids
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
        self._ids_event: Any = None  # the ids' H2D: the out stream's gathers wait for it
        self._done: Any = None  # the in stream's last event of the last selection: after all its H2D
        self._to_join = False  # this selection recorded ``_done``: ``join`` has the compute stream wait for it
        self._out_at = 0  # elements of the out buffer this selection has filled
        self._deps: list[Departure] = []  # the departures that hold rows of the out buffer
        self.slot_waits = 0  # the fill's waits for an in-ring slot (tests count them)

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

    def move(self, groups: list[Group], first: Departure | None = None) -> Callable[[], int] | None:
        """Enqueue the leaving and staying moves of one selection (each group's leaving rows to its
        pairs' ``to``, the groups of ``first`` in the first pieces) and return the fill, the
        entering part, for the CPU worker (module docstring; it returns the H2D bytes), or None
        when nothing enters. The out buffer is reused: the previous selection's departures must
        be finished (a boundary collected them since)."""
        assert not any(d.pending for d in self._deps), "the last selection's leaving rows are still in the out buffer"
        self._out_at, self._deps = 0, []
        if self._ring is None:
            n_ring, n_out, n_ids = self._sizes
            self._ring = pinned.empty(n_ring, torch.float32, pin=self.pin, device=self.device)
            self._out = pinned.empty(n_out, torch.float32, pin=self.pin, device=self.device)
            self._ids = pinned.empty(n_ids, torch.int64, pin=self.pin, device=self.device)
        if self._done is not None and not self._done.query():  # fired a select interval ago: no wait
            with self.ledger.waiting("host.migrate_slot"):
                self._done.synchronize()  # the last selection's H2D still reads the ring
        self._ring_events, self._to_join = [None] * IN_SLOTS, False
        live = [g for g in groups if any(g.plan.enter_n) or any(g.plan.stay_n) or any(g.plan.leave_n)]
        if not live:
            return None
        ids = self._upload(live)
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            self.in_stream.wait_stream(compute)  # the last device AdamW wrote the rows these read
            self.out_stream.wait_stream(compute)
            self.out_stream.wait_event(self._ids_event)
        read: dict[int, Any] = {}
        self.ledger.moved("d2h.migrate", self._out_all(live, ids, read, first))
        self._stay_all(live, ids, read)
        if not any(ids[id(g)].enter0[-1] for g in live):
            self._record_done()
            return None
        return self.ledger.charged(lambda: self._fill(live, ids))  # its bytes: this selection's step

    def join(self) -> None:
        """Main thread, after the fill ran (or when there was none): the compute stream waits on
        the device for the migration's last in-stream event, before the step's device AdamW."""
        if self._to_join:  # nothing moved: no wait (``_done`` is an earlier selection's)
            torch.cuda.current_stream(self.device).wait_event(self._done)  # device-side wait
            self.ledger.waited("device.migrate")
            self._to_join = False

    def _record_done(self) -> None:
        if self.cuda:
            self._done = torch.cuda.Event()
            self._done.record(self.in_stream)
            self._to_join = True

    # -- the ids -------------------------------------------------------------------------------
    def _upload(self, groups: list[Group]) -> dict[int, GroupIds]:
        """Every group's block-row ids, one set per distinct (plan, members), in one H2D (in stream)."""
        by_key: dict[tuple[int, tuple[int, ...]], GroupIds] = {}
        out: dict[int, GroupIds] = {}
        for g in groups:
            members = [i for i, p in enumerate(g.pairs) if p is not None]
            key = (id(g.plan), tuple(members))
            if key not in by_key:
                by_key[key] = group_ids(g.plan, members)
            out[id(g)] = by_key[key]
        sets = list(by_key.values())
        flat = torch.cat([s.host[n] for s in sets for n in IDS])
        self._ids_event = None
        if self.cuda:
            assert self._ids is not None
            src = self._ids[: flat.numel()]
            torch.cat([flat], out=src)  # host memory only: the page-locked source of the DMA
            self.ledger.moved("host.stage", 2 * 8 * flat.numel())  # written here, read by the DMA
            with torch.cuda.stream(self.in_stream):
                dev = torch.empty(flat.numel(), dtype=torch.int64, device=self.device)
            self._ids_event = copy_async(self.in_stream, dev, src, after=None)  # PCIe H2D: the ids
            dev.record_stream(self.out_stream)
        else:
            dev = flat
        o = 0
        for s in sets:
            for n in IDS:
                s.dev[n] = dev[o : o + s.host[n].numel()]
                o += s.host[n].numel()
        self.ledger.moved("h2d.migrate", 8 * flat.numel())
        return out

    # -- leaving: device -> out buffer -------------------------------------------------------
    def _out_all(self, groups: list[Group], ids: dict[int, GroupIds], read: dict[int, Any],
                 first: Departure | None) -> int:
        """Gather, pack and DMA every leaving row: one gather per group and piece; the groups whose
        leaving rows go to ``first`` in the first pieces (a release step's gradient, ``Selector.land``)."""
        order = [g for g in groups if ids[id(g)].leave0[-1] and any(p is not None and p.leaves for p in g.pairs)]
        order.sort(key=lambda g: next(p for p in g.pairs if p is not None).to is not first)  # stable
        left = sum(ids[id(g)].leave0[-1] * g.width for g in order)
        moved, fill = 0, 0
        piece: list[tuple[Group, int, int, int]] = []  # (group, first leaving row, rows, offset in the piece)
        buf = self._out_piece(left) if left else None
        for g in order:
            pos, n, w, a = ids[id(g)].dev["leave_pos"], ids[id(g)].leave0[-1], g.width, 0
            while a < n:
                assert buf is not None
                take = min(n - a, (buf.numel() - fill) // w)
                if take == 0:
                    assert fill, "a piece holds at least one row"
                    moved += self._out_flush(buf, fill, piece, ids)
                    left -= fill
                    piece, buf, fill = [], self._out_piece(left), 0
                    continue
                with self._on(self.out_stream):  # a device gather of the leaving rows of every matrix of the group
                    torch.index_select(g.dev, 0, pos[a : a + take], out=buf[fill : fill + take * w].view(take, w))
                piece.append((g, a, take, fill))
                fill, a = fill + take * w, a + take
            if self.cuda:  # the block's rows read so far; its last such event is the one the in stream waits for
                read[g.plan.block.col0] = torch.cuda.Event()
                read[g.plan.block.col0].record(self.out_stream)
        return moved + (self._out_flush(buf, fill, piece, ids) if buf is not None else 0)

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

    def _out_flush(self, buf: torch.Tensor, fill: int, piece: list[tuple[Group, int, int, int]],
                   ids: dict[int, GroupIds]) -> int:
        """One packed piece's D2H; each matrix's share of it handed to its pair's departure."""
        if fill == 0:
            return 0
        assert self._out is not None
        dst = self._out[self._out_at : self._out_at + fill]
        event = None
        if self.cuda:  # PCIe D2H of one packed piece into page-locked memory
            event = copy_async(self.out_stream, dst, buf[:fill], after=None)
        for g, a, take, off in piece:
            gi, w = ids[id(g)], g.width
            j = bisect.bisect_right(gi.leave0, a) - 1  # the member holding leaving row a
            while j < len(gi.members) and gi.leave0[j] < a + take:
                lo, hi = max(a, gi.leave0[j]), min(a + take, gi.leave0[j + 1])
                pair, m = g.pairs[gi.members[j]], g.plan.moves[gi.members[j]]
                assert pair is not None
                if hi > lo and pair.leaves:
                    if all(pair.to is not d for d in self._deps):
                        self._deps.append(pair.to)
                    rows = dst[off + (lo - a) * w : off + (hi - a) * w].view(hi - lo, w)
                    cols = m.leave_cols[lo - gi.leave0[j] : hi - gi.leave0[j]]
                    pair.to.add(pair.host, cols, rows, event, pair.scale, pair.mirror)
                j += 1
        self._out_at += fill
        self.ledger.moved("host.stage", 4 * fill)  # the DMA writes the out buffer (Departure reads it)
        return 4 * fill

    # -- staying: inside the block -------------------------------------------------------------
    def _stay_all(self, groups: list[Group], ids: dict[int, GroupIds], read: dict[int, Any]) -> None:
        """Before any write into a block's rows: the in stream waits until its leaving rows were
        read (out stream); then the staying columns change rows, a segment of whole matrices at a
        time (a matrix's rows are all gathered before any is rewritten)."""
        for event in read.values():
            self.in_stream.wait_event(event)  # device-side: the block's leaving rows are gathered
        most = max(1, sizing.STAGE_BYTES // 4)
        for g in groups:
            gi = ids[id(g)]
            bounds, a = gi.stay0, 0
            while a < len(gi.members):
                b = a + 1  # whole matrices, at least one, within ``most`` elements
                while b < len(gi.members) and (bounds[b + 1] - bounds[a]) * g.width <= most:
                    b += 1
                lo, hi = bounds[a], bounds[b]
                if hi > lo:
                    with self._on(self.in_stream):
                        staying = g.dev.index_select(0, gi.dev["stay_src"][lo:hi])  # before the rows are rewritten
                        g.dev.index_copy_(0, gi.dev["stay_dst"][lo:hi], staying)
                a = b

    # -- entering: host -> in ring -> device (the CPU worker) ----------------------------------
    def _fill(self, groups: list[Group], ids: dict[int, GroupIds]) -> int:
        """The worker: every entering row into the ring, slot by slot, each slot's H2D and one
        scatter per group part of it; then the in stream's last event (``join`` waits for it)."""
        left = sum(ids[id(g)].enter0[-1] * g.width for g in groups)
        moved, fill = 0, 0
        piece: list[tuple[Group, int, int, int]] = []  # (group, first entering row, rows, offset in the slot)
        slot = self._in_slot(left)
        for g in groups:
            gi, w = ids[id(g)], g.width
            for j, i in enumerate(gi.members):
                pair, cols = g.pairs[i], g.plan.moves[i].enter_cols
                assert pair is not None
                n, a = cols.numel(), 0
                while a < n:
                    take = min(n - a, (slot.numel() - fill) // w)
                    if take == 0:
                        assert fill, "a slot holds at least one row"
                        moved += self._in_flush(slot, fill, piece, ids)
                        left -= fill
                        piece, slot, fill = [], self._in_slot(left), 0
                        continue
                    view = slot[fill : fill + take * w].view(take, w)
                    # Host gather into the ring; a release step's gradient slot (model dtype, slots.py)
                    # is widened on the way, exactly, with no full-size temporary (departure.py).
                    gather_cast(pair.host, cols[a : a + take], view)
                    self.ledger.moved("host.migrate", pair.host.element_size() * view.numel())  # host rows read ...
                    self.ledger.moved("host.stage", 8 * view.numel())  # ... into the ring, which the DMA reads
                    if pair.scale != 1.0:
                        view.div_(pair.scale)  # exact: a power of two
                        self.ledger.moved("host.stage", 8 * view.numel())  # read and written in place
                    row = gi.enter0[j] + a
                    if piece and piece[-1][0] is g and piece[-1][1] + piece[-1][2] == row:
                        piece[-1] = (g, piece[-1][1], piece[-1][2] + take, piece[-1][3])  # one scatter
                    else:
                        piece.append((g, row, take, fill))
                    fill, a = fill + take * w, a + take
        moved += self._in_flush(slot, fill, piece, ids)
        self._record_done()
        self.ledger.moved("h2d.migrate", moved)
        return moved

    def _in_slot(self, left: int) -> torch.Tensor:
        """The next in-ring slot, once the DMA that last read it is done (a wait of the worker only
        when a selection brings in more than the ring holds, paced by the link)."""
        assert self._ring is not None
        i = self._next_slot
        self._next_slot = (i + 1) % IN_SLOTS
        if self._ring_events[i] is not None:
            with self.ledger.waiting("worker.migrate_slot"):
                self._ring_events[i].synchronize()  # sync point (worker): slot i's previous H2D
            self._ring_events[i] = None
            self.slot_waits += 1
        return self._ring[i * self._slot_elems : i * self._slot_elems + min(self._slot_elems, left)]

    def _in_flush(self, slot: torch.Tensor, fill: int, piece: list[tuple[Group, int, int, int]],
                  ids: dict[int, GroupIds]) -> int:
        if fill == 0:
            return 0
        src = slot[:fill]
        if self.cuda:
            with torch.cuda.stream(self.in_stream):
                src = torch.empty(fill, dtype=torch.float32, device=self.device)
            # PCIe H2D of one packed piece from page-locked memory; the slot is free after it.
            event = copy_async(self.in_stream, src, slot[:fill], after=None)
            self._ring_events[(self._next_slot - 1) % IN_SLOTS] = event
        for g, row, take, off in piece:
            w = g.width
            with self._on(self.in_stream):  # off CUDA: reads the slot before it is refilled
                g.dev.index_copy_(0, ids[id(g)].dev["enter_dst"][row : row + take], src[off : off + take * w].view(take, w))
        return 4 * fill

    def _on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()
