"""The fences of the CUDA transfer paths, checked on CPU: which copy the install's fence is, who
waits for it, and what the device path's copy out waits for (tests/offload/cuda_shim.py runs the
CUDA branches on CPU memory and logs the waits). The races these waits prevent need a GPU to
show as wrong bits: tests/gpu/test_race_stress.py."""

from __future__ import annotations

import threading

import torch
from cuda_shim import FakeEvent, as_cuda, fake_cuda
from slow_readers import slow_readers
from test_offload_helpers import batches, snapshot, tiny_net, zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.device import pinned
from zfctl.offload.device.ring import Ring

HP = {"lr": 1e-2, "weight_decay": 0.01}
BASE = {"topk_ratio": 0.1, "update_interval": 3, "select_interval": 6}


def test_page_locked_is_read_from_the_registry_by_address_range(monkeypatch) -> None:
    """pinned.holds answers from the registry, for the buffer and any view inside it; torch's
    is_pinned() (asked of the storage's unaligned base) is not consulted."""
    fake_cuda(monkeypatch)
    buf = pinned.empty(3000, torch.float32, pin=True)
    assert buf.data_ptr() % pinned.PAGE == 0 and not buf.is_pinned()  # what torch would say
    assert pinned.holds(buf) and pinned.holds(buf[1000:2000]) and pinned.holds(buf[2999:])
    assert not pinned.holds(torch.empty(3000)) and not pinned.holds(buf[:0])
    # A view reaching past the registered pages is not covered (the registration is whole pages).
    span = -(-buf.numel() * 4 // pinned.PAGE) * pinned.PAGE
    past = torch.as_strided(buf, (span // 4 + 1,), (1,))
    assert not pinned.holds(past)
    pinned.release(buf)
    assert not pinned.holds(buf)


def _h2d(monkeypatch, pin: bool):
    shim = fake_cuda(monkeypatch)
    n, per = 8, 256
    src = pinned.empty(n * per, torch.float32, pin=pin)
    src.copy_(torch.arange(n * per, dtype=torch.float32))
    ring = as_cuda(Ring(torch.device("cpu"), 2, per * 4, pin), "stream")
    out = torch.zeros(n * per)

    def deliver(dev: torch.Tensor, i: int) -> None:
        out[i * per : (i + 1) * per].copy_(dev)

    nbytes, fence = ring.h2d(((src[i * per : (i + 1) * per], i) for i in range(n)), deliver)
    assert nbytes == n * per * 4 and torch.equal(out, src)
    return shim, ring, src, fence


def test_an_install_from_a_registered_master_returns_its_last_copy_as_the_fence(monkeypatch) -> None:
    """The install fence (docs/design.md, "Threads and buffer ownership"): from page-locked memory the H2D copy is a DMA that reads the master
    after the call; the install must hand back the event after its last copy."""
    _, ring, src, fence = _h2d(monkeypatch, pin=True)
    records = [what for op, what in ring.stream.log if op == "record"]
    assert fence is not None and fence is records[-1]  # the event after the last copy
    assert ("copy", (ring._device.data_ptr() + 1 * 256 * 4, src[7 * 256 :].data_ptr())) in fence.after
    pinned.release(src)


def test_an_install_from_pageable_memory_has_no_fence(monkeypatch) -> None:
    """From pageable memory CUDA stages the source inside the copy call: nothing to fence."""
    _, _, _, fence = _h2d(monkeypatch, pin=False)
    assert fence is None


def test_the_worker_waits_for_the_install_fence_before_it_writes_the_master(monkeypatch) -> None:
    """The fence an install leaves (HostState.install_fence) is the first thing the next CPU
    update waits for (pipeline.py ``_install_wait``), and it is handed over once."""
    cfg = zen(**BASE, accumulate="host", overlap_step=True, full_warm_up_rounds=0)
    model = tiny_net()
    events: list[str] = []

    class Fence:
        def synchronize(self) -> None:
            events.append(f"fence on {threading.current_thread().name.split('_')[0]}")

    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        run = opt.pipeline.worker.run

        def logged(update):
            events.append("update")
            return run(update)

        monkeypatch.setattr(opt.pipeline.worker, "run", logged)
        install = opt.pipeline._install

        def fenced(stats):
            install(stats)
            events.append("install")
            opt.host.install_fence = Fence()  # what a CUDA install leaves (ring.py h2d)

        monkeypatch.setattr(opt.pipeline, "_install", fenced)
        for x, y in batches(10):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.flush()
        assert opt.host.install_fence is not None  # the last install's: close() waits for it
    assert opt.host.install_fence is None
    # Between an install and the next update that writes the master, that install's fence was
    # waited for: by the worker itself (a boundary) or by the main thread (a selection's migration).
    last_install = None
    for i, e in enumerate(events):
        if e == "install":
            last_install = i
        elif e == "update" and last_install is not None:
            assert any(w.startswith("fence") for w in events[last_install:i]), events
    assert events.count("update") >= 2 and "fence on zenflow-cpu" in events
    assert events[-2:] == ["install", "fence on MainThread"]  # close(): before the master is unpinned


def test_load_state_dict_waits_for_the_update_in_flight(monkeypatch) -> None:
    """Loading into a live optimizer whose CPU update still runs must wait
    for it before it fills master, moments and accumulator; else the update writes over the
    loaded state. The update is held back (a slow reader) until the load has returned or 1 s
    passed, so a load that does not wait is overwritten every time."""
    cfg = zen(**BASE, accumulate="host", overlap_step=True, full_warm_up_rounds=0)
    model = tiny_net()
    data = batches(8)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        for x, y in data[:4]:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        saved = _deep(opt.state_dict())  # a snapshot: state_dict() returns the live buffers
        loaded = threading.Event()
        run = opt.pipeline.worker.run

        def slow(update):
            loaded.wait(timeout=1.0)  # the reader is late: after the load, unless the load waits
            return run(update)

        monkeypatch.setattr(opt.pipeline.worker, "run", slow)
        for x, y in data[4:6]:  # to the next boundary: an update in flight
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        assert opt.pipeline.busy
        opt.load_state_dict(saved)
        loaded.set()
        opt.flush()  # any late update lands here (it must not: the load discarded it)
        got = {k: v.clone() for k, v in opt.host.state_dict().items()}
    with ZenFlowOptimizer(tiny_net().named_parameters(), cfg, **HP) as fresh:
        fresh.load_state_dict(saved)
        fresh.flush()
        want = fresh.host.state_dict()
        for k in want:
            assert torch.equal(got[k], want[k]), k


def _deep(sd: dict) -> dict:
    """A deep copy of a state dict (state_dict() returns the live buffers)."""
    def cp(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, dict):
            return {k: cp(x) for k, x in v.items()}
        if isinstance(v, list):
            return [cp(x) for x in v]
        return v

    return cp(sd)


def test_the_sum_copy_out_waits_for_the_adds_not_for_the_install(monkeypatch) -> None:
    """At a boundary the compute stream already holds the install (it waits
    for every H2D chunk) when the device path's sum is copied out. The copy stream must wait for
    the event after the interval's last add only, so the D2H overlaps the H2D; a wait for the
    compute stream would order it after the whole install."""
    cfg = zen(**BASE, accumulate="device", overlap_step=True, full_warm_up_rounds=0)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        grads = [torch.randn_like(p) for p in opt.params]
        acc = opt.gradient_path.sum
        shim = fake_cuda(monkeypatch)
        as_cuda(acc, "copy_stream")
        acc.add(grads, None, first=True)
        acc.add(grads, None, first=False)
        added = acc._added
        install = torch.cuda.Event()
        install.record(shim.compute)  # what the boundary's install enqueues on compute meanwhile
        fence = acc.copy_out(opt.gradient_path.host_sum, opt.transfers.chunks)
        waits = acc.copy_stream.waits
        assert waits == [("wait_event", added)], waits  # one wait, for the adds
        assert ("record", added) in shim.compute.log and added.after.count(("record", install)) == 0
        assert fence is not None  # the worker's wait: the last copy's event
        assert shim.host_syncs == []  # the adds and the copy out make the host wait for nothing
        assert torch.equal(opt.gradient_path.host_sum, acc.buf)
        # The next interval's first add into a matrix waits (on the device) for its copy out only.
        acc.add(grads, None, first=True)
        copied = [what for op, what in shim.compute.log if op == "wait_event"]
        assert len(copied) == sum(s.host_numel > 0 for s in opt.layout.host_slots)
        acc.wait()
        acc.cuda = False  # close() on CPU


def _train_with(cfg, *, clip=None, update_s=0.0, hooks: bool, steps: int = 10):
    from test_offload_stream import run as run_loop

    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        slow_readers(opt, update_s=update_s)
        run_loop(model, opt, batches(steps), hooks=hooks)
        opt.flush()
    return snapshot(model)


def test_the_cpu_update_waits_for_the_last_copy_into_its_slots(monkeypatch) -> None:
    """The hook path's copies into a step's slot are DMAs on one copy stream (stream.py): each
    waits for the compute stream (the transpose), and the CPU update of the interval waits, on its
    own thread, for the event recorded after the interval's last copy, which follows every copy
    of that interval on the stream. Run through the shim: the copy stream's log shows the order,
    the worker's waits which event it took."""
    cfg = zen(**BASE, accumulate="host", overlap_step=True, full_warm_up_rounds=0,
              release_grads=False)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        shim = fake_cuda(monkeypatch)
        stream = as_cuda(opt.gradient_path.stream, "copy_stream")
        submitted: list[tuple[object, int]] = []
        synced: list[object] = []  # events the CPU worker's thread synchronized (its waits)
        submit = opt.pipeline.worker.submit
        sync = FakeEvent.synchronize

        def recorded(update, waits=()):
            submitted.append((stream.last, len(stream.copy_stream.log)))
            return submit(update, waits)

        def logged(event) -> None:
            if threading.current_thread().name.startswith("zenflow-cpu"):
                synced.append(event)
            sync(event)

        monkeypatch.setattr(opt.pipeline.worker, "submit", recorded)
        monkeypatch.setattr(FakeEvent, "synchronize", logged)
        for x, y in batches(7):
            opt.zero_grad(set_to_none=True)
            opt.prepare_backward(final=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.flush()
        log = stream.copy_stream.log
        copies = [i for i, (op, _) in enumerate(log) if op == "copy"]
        assert copies and all(log[i - 1] == ("wait_stream", shim.compute) for i in copies)  # after the transpose
        assert len(submitted) >= 2
        for last, n in submitted:
            assert last is not None and last in synced  # the worker waits for ...
            assert log[n - 1] == ("record", last)  # ... the event after the interval's last copy
        monkeypatch.undo()  # before close(): the real streams and copies again


def test_device_path_with_a_late_cpu_update_is_bit_identical() -> None:
    """The device path has one host accumulator: the boundary collects the previous CPU update
    before the new sum lands in it (pipeline.py ``submit``: collect, then ``prepare``, which copies
    the sum out). Each update here reads late, so a copy out before the collect overwrites its input."""
    cfg = zen(**BASE, accumulate="device", overlap_step=True, full_warm_up_rounds=1)
    ref = _train_with(cfg, clip=0.5, hooks=False)
    got = _train_with(cfg, clip=0.5, hooks=False, update_s=0.05)
    for n in ref:
        assert torch.equal(ref[n], got[n]), n


def test_host_waits_of_the_transfer_calls_are_the_listed_ones(monkeypatch) -> None:
    """How often each transfer call makes the host wait (docs/design.md, "Transfer scheduling",
    sync points), counted through the shim: an install and the device path's sum make none
    (device-side waits only), the scalar fetch one when its result is read, and the copies of a
    step's gradient into its slot none (the CPU update waits for the last one, on its thread)."""
    shim = fake_cuda(monkeypatch)
    n, per = 5, 64
    ring = as_cuda(Ring(torch.device("cpu"), 2, per * 4, True), "stream")
    src = pinned.empty(n * per, torch.float32, pin=True)
    src.copy_(torch.arange(n * per, dtype=torch.float32))
    ring.h2d(((src[i * per : (i + 1) * per], i) for i in range(n)), lambda dev, i: None)
    assert shim.host_syncs == []  # the install: waited for on the device only
    result = ring.fetch(torch.tensor([1.0, 2.0]))
    assert shim.host_syncs == []  # started, not waited for
    assert result().tolist() == [1.0, 2.0] and len(shim.host_syncs) == 1
    pinned.release(src)
    cfg = zen(**BASE, accumulate="host", full_warm_up_rounds=0)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        stream = as_cuda(opt.gradient_path.stream, "copy_stream")
        for t, (x, y) in enumerate(batches(2)):  # step 0 selects; step 1 is an ordinary one
            shim.host_syncs.clear()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            stats = opt.step()
        assert not stats.boundary and stats.in_step_chunks > 0
        assert shim.host_syncs == []  # every chunk's copy into the slot: no host wait
        assert [op for op, _ in stream.copy_stream.log].count("copy") >= stats.in_step_chunks
        monkeypatch.undo()


def test_the_device_path_update_follows_the_sum_matrix_by_matrix(monkeypatch) -> None:
    """The device path's copy out moves the host-owned columns only (``GAP_ELEMS`` 0 here: no
    device-owned column rides along), one event per matrix, and ``StepStats.d2h_bytes`` counts
    what it moved. The CPU update waits for each matrix's own event just before that matrix's
    runs, in copy order (``PieceWaits``, worker.py ``fences``): the first matrix is updated
    before the last one's wait. A wait for the last event only, or none, fails here; that a
    missing wait reads the sum before it lands shows on a GPU (tests/gpu/test_race_stress.py)."""
    from cuda_shim import FakeEvent

    from zfctl.offload.grads import device_acc

    monkeypatch.setattr(device_acc, "GAP_ELEMS", 0)
    shim = fake_cuda(monkeypatch)
    log: list[tuple[str, object]] = []
    monkeypatch.setattr(FakeEvent, "synchronize",
                        lambda self: log.append(("wait", self)) if threading.current_thread().name.startswith("zenflow-cpu")
                        else None)
    cfg = zen(**BASE, accumulate="device", overlap_step=True, full_warm_up_rounds=0)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        acc = as_cuda(opt.gradient_path.sum, "copy_stream")
        slots = opt.layout.host_slots
        worker = opt.pipeline.worker
        adamw = worker._adamw

        def logged(update, step, part):
            lo = int(part[0, 0])
            log.append(("adamw", next(i for i, s in enumerate(slots) if s.host_off <= lo < s.host_off + s.host_numel)))
            adamw(update, step, part)

        monkeypatch.setattr(worker, "_adamw", logged)
        copies: list[tuple[object, torch.Tensor]] = []
        copy_out = acc.copy_out

        def recorded(dst, chunks):
            owned = ~opt.host.device_owned.clone()
            fences = copy_out(dst, chunks)
            copies.append((fences, owned))
            return fences

        monkeypatch.setattr(acc, "copy_out", recorded)
        stats = []
        for x, y in batches(12):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            stats.append(opt.step())
        opt.flush()
        acc.wait()
        acc.cuda = False
    assert len(copies) == sum(s.boundary for s in stats) >= 3
    for (fences, owned), st in zip(copies, [s for s in stats if s.boundary]):
        host_owned = sum(int(owned[s.host_col0 : s.host_col0 + s.host_c1 - s.host_c0].sum()) * s.rows for s in slots)
        nbytes = st.bytes["d2h.sum"]  # counted by copy_out (ledger.py)
        assert nbytes == 4 * host_owned and st.d2h_bytes - nbytes == 8  # the sum's host columns + the scalars
        events = [wait.__self__ for _, _, wait in fences.pieces]
        lasts = [e for op, e in acc.copy_stream.log if op == "record"]
        assert all(e in lasts for e in events) and len(events) == len(slots)
    waits = [e for op, e in log if op == "wait"]
    assert waits == [wait.__self__ for fences, _ in copies for _, _, wait in fences.pieces]  # each, in order
    for fences, _ in copies:  # each matrix's runs after its own wait, before the next matrix's
        evs = [wait.__self__ for _, _, wait in fences.pieces]
        for i, ev in enumerate(evs):
            at = log.index(("wait", ev))
            assert log[at + 1] == ("adamw", i), log[at : at + 2]
    assert shim.host_syncs == []  # the training thread never waited for the copy out
