"""A selection step does not stop for the CPU pipeline (selector.py, migration.py).

The update submitted at the boundary one step before a selection may still run at the selection.
The step waits for the entering columns' part of it only (worker.py ``request``, ``wait_request``), never for
the whole update, installs nothing early, and the leaving columns' state is written by the
worker behind the update, before anything reads it. Each test holds the worker back so that a
planted drain, early install or whole-update wait shows: as a wait counted, as an update that
finished inside the selection step, or as other bits than a run with a fast worker.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from test_offload_helpers import batches, snapshot, tiny_net, zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.columns import migration
from zfctl.offload.cpu import runs

HP = {"lr": 1e-2, "weight_decay": 0.01}
PATHS = {"host-step": {"accumulate": "host"},  # the loop announces no backward: step() lands
         "host-hooks": {"accumulate": "host"},
         "device": {"accumulate": "device"}}
SELECT = 6  # selections at 0, 6, 12; the boundary at 5 submits the update the selection at 6 meets


def _cfg(path: str, **kw: Any):
    return zen(topk_ratio=0.25, update_interval=3, select_interval=SELECT, overlap_step=True,
               full_warm_up_rounds=0, **PATHS[path], **kw)


def _step(model, opt, x, y, hooks: bool):
    opt.zero_grad(set_to_none=True)
    if hooks:
        opt.prepare_backward(final=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return opt.step()


class Held:
    """Holds the CPU worker's current update between its pieces (after the first) until a
    priority request arrives or ``release`` is set (at most ``deadline`` s per piece), and
    records when an update finishes."""

    def __init__(self, opt: ZenFlowOptimizer, deadline: float = 5.0) -> None:
        self.release, self.finished = threading.Event(), threading.Event()
        worker = opt.pipeline.worker
        run = worker.run

        def before_piece(i: int) -> None:
            t0 = time.monotonic()
            while i and not self.release.is_set() and not worker.requested and time.monotonic() - t0 < deadline:
                time.sleep(0.001)

        def finishing(update):
            out = run(update)
            self.finished.set()
            return out

        worker.before_piece, worker.run = before_piece, finishing


def _count(monkeypatch, opt: ZenFlowOptimizer) -> dict[str, int]:
    """Calls of the waits a drain, an early install or a whole-update wait would make."""
    counts = {"worker.wait": 0, "install": 0, "wait_install": 0}
    for name, obj, attr in (("worker.wait", opt.pipeline.worker, "wait"), ("install", opt.pipeline, "_install"),
                            ("wait_install", opt.host, "wait_install")):
        fn = getattr(obj, attr)

        def counted(*a, _fn=fn, _name=name, **k):
            counts[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(obj, attr, counted)
    return counts


@pytest.mark.parametrize("path", list(PATHS))
def test_a_selection_waits_for_the_entering_part_only(monkeypatch, path: str) -> None:
    """At step 6 the update submitted at step 5 is held between its pieces: the selection step
    returns while it still runs, with one priority wait and no worker wait, no install and no
    install wait; the run ends with the bits of a run whose worker was never held."""
    monkeypatch.setattr(runs, "PIECE_ELEMS", 200)  # many pieces in a tiny model
    hooks = path == "host-hooks"
    data = batches(3 * SELECT)

    def run(hold: bool):
        model = tiny_net()
        with ZenFlowOptimizer(model.named_parameters(), _cfg(path), **HP) as opt:
            for x, y in data[:5]:
                _step(model, opt, x, y, hooks)
            opt.pipeline.settle()  # the update of step 2 done: only the next one is held
            held = Held(opt) if hold else None
            _step(model, opt, *data[5], hooks)  # the boundary before the selection
            assert opt.pipeline.busy
            counts, waited = _count(monkeypatch, opt), opt.pipeline.worker.priority_waits
            stats = _step(model, opt, *data[6], hooks)
            if held is not None:
                assert stats.selection and not stats.installed
                assert counts == {"worker.wait": 0, "install": 0, "wait_install": 0}, counts
                assert opt.pipeline.worker.priority_waits == waited + 1
                assert opt.pipeline.busy and not held.finished.is_set()  # no whole-update wait
                held.release.set()
            monkeypatch.undo()
            monkeypatch.setattr(runs, "PIECE_ELEMS", 200)
            for x, y in data[7:]:
                _step(model, opt, x, y, hooks)
            opt.flush()
        return snapshot(model)

    ref, got = run(False), run(True)
    assert all(torch.equal(ref[n], got[n]) for n in ref)


def test_late_leaving_state_is_written_before_the_install_reads_it(monkeypatch) -> None:
    """The worker writes the leaving columns' host rows behind the update in flight
    (``Pipeline.defer``); the next boundary's install reads them. Each write here starts late:
    an install that did not wait for it (``Pipeline.settle``'s ``join_deferred``) would put the
    leaving columns' stale host values into the model."""
    finish = migration.Departure.finish

    def late(self) -> None:
        if self.pending:
            time.sleep(0.5)  # the next boundary comes two tiny steps later
        finish(self)

    def run(slow: bool):
        model = tiny_net()
        if slow:
            monkeypatch.setattr(migration.Departure, "finish", late)
        with ZenFlowOptimizer(model.named_parameters(), _cfg("host-step"), **HP) as opt:
            for x, y in batches(3 * SELECT):
                _step(model, opt, x, y, False)
            opt.flush()
        monkeypatch.undo()
        return snapshot(model)

    ref, got = run(False), run(True)
    assert all(torch.equal(ref[n], got[n]) for n in ref)


@pytest.mark.parametrize("at", [SELECT - 1, SELECT], ids=["before-selection", "at-selection"])
@pytest.mark.parametrize("path", ["host-step", "device"])
def test_a_checkpoint_around_a_selection_resumes_exactly(path: str, at: int) -> None:
    """Saved at the boundary before a selection (an update in flight) or at the selection (the
    update still in flight, the leaving state not yet written): the resumed run continues with
    the bits of the uninterrupted one, its install at the same step."""
    data = batches(3 * SELECT)

    def straight():
        model = tiny_net()
        with ZenFlowOptimizer(model.named_parameters(), _cfg(path), **HP) as opt:
            stats = [_step(model, opt, x, y, False) for x, y in data]
            opt.flush()
        return snapshot(model), [s.installed for s in stats]

    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), _cfg(path), **HP) as opt:
        for x, y in data[: at + 1]:
            _step(model, opt, x, y, False)
        sd = {k: v for k, v in opt.state_dict().items()}
        saved = _clone(sd)
        params = {k: v.clone() for k, v in model.state_dict().items()}
    resumed = tiny_net()
    resumed.load_state_dict(params)
    with ZenFlowOptimizer(resumed.named_parameters(), _cfg(path), **HP) as opt:
        opt.load_state_dict(saved)
        stats = [_step(resumed, opt, x, y, False) for x, y in data[at + 1 :]]
        opt.flush()
    want, installed = straight()
    got = snapshot(resumed)
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert [s.installed for s in stats] == installed[at + 1 :]


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clone(x) for x in v]
    return v


def test_a_selection_waits_once_on_the_training_thread_and_moves_by_dma(monkeypatch) -> None:
    """Through the CUDA shim (tests/offload/cuda_shim.py; the migration on its CUDA branch): the
    selection step's training thread makes one host wait, for the new column ids; every copy
    that touches page-locked memory is a non_blocking DMA on one of the migration's two streams;
    the in stream waits for the out stream to have gathered each block's leaving rows before
    it writes there; the compute stream waits (device-side) for the migration; and the worker,
    not the training thread, waits for the leaving rows' D2H events before it writes them."""
    from cuda_shim import FakeEvent, as_cuda, fake_cuda

    from zfctl.offload.device import pinned

    shim = fake_cuda(monkeypatch)
    syncs: list[tuple[str, Any]] = []
    monkeypatch.setattr(FakeEvent, "synchronize", lambda self: syncs.append((threading.current_thread().name, self)))
    model = tiny_net()
    data = batches(SELECT + 1)
    with ZenFlowOptimizer(model.named_parameters(), _cfg("host-step"), **HP) as opt:
        mover = as_cuda(opt.selector._mover(3), "in_stream", "out_stream")
        mover.pin = True
        for x, y in data[:SELECT]:
            _step(model, opt, x, y, False)
        opt.pipeline.settle()
        syncs.clear()
        shim.copies.clear()
        out_log, in_log = len(mover.out_stream.log), len(mover.in_stream.log)
        stats = _step(model, opt, *data[SELECT], False)
        assert stats.selection
        main = [e for thread, e in syncs if thread == "MainThread"]
        assert len(main) == 1 and main[0].stream is mover.out_stream  # the ids' D2H, nothing else
        dma = [c for c in shim.copies if pinned.holds(c[1]) or pinned.holds(c[2])]
        assert dma and all(blocking is True and stream in (mover.in_stream, mover.out_stream)
                           for stream, _, _, blocking, _ in dma)
        log = mover.out_stream.log[out_log:]
        copied = [e for i, (op, e) in enumerate(log) if op == "record" and log[i - 1][0] == "copy"]
        reads = [e for i, (op, e) in enumerate(log) if op == "record" and log[i - 1][0] != "copy"]
        waited = [e for op, e in mover.in_stream.log[in_log:] if op == "wait_event"]
        # The in stream waits, per device block with leaving rows (one column length each), for
        # the event after the block's last gather.
        leaving = len({m.slot.rows for m in opt.selector.moves if m.leave_cols.numel()})
        assert leaving > 1 and reads[-1] in waited and len({id(e) for e in waited if e in reads}) == leaving
        done = [e for op, e in mover.in_stream.log if op == "record"][-1]
        assert ("wait_event", done) in shim.compute.log  # the device AdamW waits on the device
        d2h = [e for e in copied if e is not main[0]]  # the leaving rows' pieces
        assert d2h and not any(e in main for e in d2h)
        opt.pipeline.settle()  # the worker writes the leaving rows behind the update
        on_worker = [e for thread, e in syncs if thread.startswith("zenflow-cpu")]
        assert all(e in on_worker for e in d2h)


@pytest.mark.parametrize("path", ["host-step", "device"])
def test_the_entering_rows_are_gathered_on_the_worker_thread(monkeypatch, path) -> None:
    """The fill (migration.py) gathers every entering row into the in ring on the CPU worker's
    thread, never the training thread's: at the first selection (step 0, no update in flight:
    the worker thread runs it at once) and at step 6 (inside the update in flight, right after
    its entering columns). A selection that called the fill itself, or gathered rows in
    ``Mover.move``, shows as a gather on MainThread."""
    threads: list[str] = []
    gather = migration.gather_cast

    def recorded(*a: Any) -> None:
        threads.append(threading.current_thread().name)
        gather(*a)

    monkeypatch.setattr(migration, "gather_cast", recorded)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), _cfg(path), **HP) as opt:
        for t, (x, y) in enumerate(batches(SELECT + 1)):
            threads.clear()
            stats = _step(model, opt, x, y, False)
            if t in (0, SELECT):
                assert stats.selection and threads, t
                assert all(name.startswith("zenflow-cpu") for name in threads), (t, set(threads))
