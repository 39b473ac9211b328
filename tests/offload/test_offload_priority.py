"""The CPU worker's pieces: a selection's priority request and the device path's per-matrix waits.

A selection no longer drains the update in flight: it asks the worker to update the entering
columns first (``CpuWorker.prioritize``) and waits for that part only; the worker leaves them out
of the rest. AdamW is per element (native/kernels.h), so the bits must be those of the plain
update wherever the request arrives. On the device path the update waits for each matrix's copy
event just before that matrix's runs, in copy order (``fences``), so it overlaps the copy out.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from test_offload_helpers import tiny_net, zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.cpu import runs
from zfctl.offload.cpu import worker as worker_mod
from zfctl.offload.cpu.runs import runs_and, runs_minus
from zfctl.offload.cpu.worker import CpuWorker, cpu_update
from zfctl.offload.layout import column_runs

HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _as_set(r: torch.Tensor) -> set[int]:
    return {e for off, n in r.tolist() for e in range(off, off + n)}


def test_run_set_operations_match_element_sets() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        a = column_runs(torch.rand(40, generator=g) < 0.5, torch.arange(0, 41 * 3, 3))
        b = column_runs(torch.rand(40, generator=g) < 0.5, torch.arange(0, 41 * 3, 3))
        b[:, 0] += int(torch.randint(0, 3, (1,), generator=g))  # edges that do not line up with a's
        assert _as_set(runs_and(a, b)) == _as_set(a) & _as_set(b)
        assert _as_set(runs_minus(a, b)) == _as_set(a) - _as_set(b)
        out = runs_minus(a, b)
        assert (out[1:, 0] > out[:-1, 0] + out[:-1, 1]).all()  # sorted, disjoint, touching runs joined


def _host(seed: int = 0):
    """A real host state (tiny model) with random master, moments and an interval of two steps'
    gradient slots (slots.py), and a plain update of it."""
    cfg = zen(topk_ratio=0.25, accumulate="host", overlap_step=True)
    opt = ZenFlowOptimizer(tiny_net().named_parameters(), cfg, lr=HP["lr"])
    host = opt.host
    g = torch.Generator().manual_seed(seed)
    for t in (host.master, host.exp_avg):
        t.copy_(torch.randn(t.shape, generator=g))
    for coef in (1.0, 0.5):  # two steps, each with its own coefficient
        host.grads.next(0).copy_(torch.randn(host.grads.numel, generator=g))
        host.grads.record(0, coef)
    host.exp_avg_sq.copy_(torch.rand(host.exp_avg_sq.shape, generator=g))
    host.device_owned[torch.randperm(host.layout.host_cols, generator=g)[:10]] = True
    host.steps[:5] = 3.0  # two counter groups: two native calls per piece
    update = cpu_update("off", 2, host.grads.take(0), host.update_groups, HP)
    return opt, host, update


def _state(host) -> list[torch.Tensor]:
    return [t.clone() for t in (host.master, host.exp_avg, host.exp_avg_sq)]


def _entering(host, g: torch.Generator) -> torch.Tensor:
    """Some host-owned columns, as a run list: what a selection brings onto the device."""
    cols = torch.nonzero(~host.device_owned).flatten()
    pick = torch.zeros(host.layout.host_cols, dtype=torch.bool)
    pick[cols[torch.randperm(len(cols), generator=g)[: len(cols) // 3]]] = True
    return column_runs(pick, host.layout.host_col_offsets)


@pytest.mark.parametrize("at", [0, 2, 5, "done"])
def test_a_priority_request_gives_the_bits_of_the_plain_update(monkeypatch, at) -> None:
    """The request arrives before piece ``at`` (or once the update is done): when it returns, the
    requested elements hold their updated bits and the pieces after ``at`` are untouched; at the
    end every element equals the plain update's, bit for bit (none updated twice, none missed)."""
    monkeypatch.setattr(runs, "PIECE_ELEMS", 700)  # many pieces in a tiny model
    opt, host, update = _host()
    before = _state(host)
    worker = CpuWorker(host, torch.device("cpu"))
    worker.submit(update)
    worker.wait()
    want = _state(host)
    for t, b in zip((host.master, host.exp_avg, host.exp_avg_sq), before):
        t.copy_(b)
    request = _entering(host, torch.Generator().manual_seed(1))
    elems = torch.tensor(sorted(_as_set(request)))
    pieces = worker._pieces(update)
    assert len(pieces) > 6
    release = threading.Event()
    stop = None if at == "done" else at

    def before_piece(i: int) -> None:
        if i == stop:  # hold the worker here until the request is posted, then serve it late
            t0 = time.monotonic()
            while not worker.requested and time.monotonic() - t0 < 10:
                time.sleep(0.001)
            time.sleep(0.2)  # a requester that does not wait reads the elements before this
        elif stop is not None and i == stop + 1:
            assert release.wait(10)  # the rest waits until the test has looked

    worker.before_piece = before_piece
    worker.submit(update)
    if at == "done":
        worker.wait()
    ms = worker.prioritize(request)
    got = _state(host)
    for now, old, new in zip(got, before, want):
        assert torch.equal(now[elems], new[elems])  # the requested elements are updated
        if stop is not None:
            later = pieces[stop + 1][0]  # the pieces after ``at`` have not run yet
            untouched = torch.tensor(sorted(e for e in range(later, host.master.numel()) if e not in set(elems.tolist())))
            changed = ~torch.eq(new[untouched], old[untouched])
            assert changed.any() and torch.equal(now[untouched], old[untouched])
    assert (ms == 0.0) == (at == "done")
    release.set()
    worker.wait()
    for a, b in zip(_state(host), want):
        assert torch.equal(a, b)
    worker.close()
    opt.close()


def test_per_piece_waits_come_in_copy_order_before_each_piece(monkeypatch) -> None:
    """The device path's update (``fences``): each matrix's wait runs just before its runs, in
    copy order, so the first matrix is updated while the later ones are still on the link. A
    wait for the last event only, or none, shows in the log."""
    opt, host, update = _host()
    log: list[tuple[str, int]] = []
    slots = host.layout.host_slots

    def waiter(i: int):
        return lambda: log.append(("wait", i))

    fences = tuple((s.host_off, s.host_numel, waiter(i)) for i, s in enumerate(slots))
    worker = CpuWorker(host, torch.device("cpu"))
    adamw = worker._adamw

    def logged(update, step, part):
        lo = int(part[0, 0])
        log.append(("adamw", next(i for i, s in enumerate(slots) if s.host_off <= lo < s.host_off + s.host_numel)))
        adamw(update, step, part)

    monkeypatch.setattr(worker, "_adamw", logged)
    from dataclasses import replace

    worker.submit(replace(update, fences=fences))
    worker.wait()
    waits = [i for op, i in log if op == "wait"]
    assert waits == list(range(len(slots)))  # every matrix's own event, in copy order
    for i in range(len(slots)):
        first = log.index(("adamw", i))
        assert log.index(("wait", i)) < first  # waited before its runs ...
        if i + 1 < len(slots):
            assert ("wait", i + 1) not in log[:first]  # ... and before the next matrix had landed
    worker.close()
    opt.close()


def test_cut_runs_gives_each_pieces_clip_at_once() -> None:
    """``cut_runs`` cuts several run lists to pieces in any order in one pass: each part equals
    that piece's ``clip_runs``, elements outside every piece dropped."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        lists = [column_runs(torch.rand(40, generator=g) < p, torch.arange(0, 41 * 3, 3)) for p in (0.3, 0.7)]
        edges = sorted(set(torch.randint(1, 120, (6,), generator=g).tolist()) | {0, 120})
        pieces = [(a, b - a) for a, b in itertools.pairwise(edges)]
        pieces = [pieces[k] for k in torch.randperm(len(pieces), generator=g).tolist()][1:]  # shuffled, one left out
        out = runs.cut_runs(lists, pieces)
        for (off, n), parts in zip(pieces, out):
            for r, part in zip(lists, parts):
                assert torch.equal(part, worker_mod.clip_runs(r, (r[:, 0] + r[:, 1]).contiguous(), off, off + n))


def test_a_priority_request_cuts_its_runs_once(monkeypatch) -> None:
    """Serving a request cuts its runs to all the pieces left in one ``cut_runs`` (no cut, and no
    set algebra, per piece and counter group: that cost ~100 ms at 1B parameters), and the
    remaining update then reads the lists built once, which no longer hold the request's elements."""
    monkeypatch.setattr(runs, "PIECE_ELEMS", 700)
    opt, host, update = _host()
    worker = CpuWorker(host, torch.device("cpu"))
    pieces = worker._pieces(update)
    assert len(pieces) > 6
    request = _entering(host, torch.Generator().manual_seed(1))
    calls = []
    for name in ("clip_runs", "cut_runs"):
        real = getattr(worker_mod, name)
        monkeypatch.setattr(worker_mod, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    monkeypatch.setattr(worker, "_adamw", lambda *a: None)
    worker._request = worker_mod._Request(request)
    left = [(step, r, (r[:, 0] + r[:, 1]).contiguous()) for step, r in update.groups]
    worker._serve(update, pieces, 2, left, set())
    assert calls == ["cut_runs"] and worker.priority_cuts == 1
    assert all(not runs_and(r, request).shape[0] for _, r, _ in left)
    worker.close()
    opt.close()
