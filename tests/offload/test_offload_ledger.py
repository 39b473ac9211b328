"""The byte ledger and the wait counts of every step (zfctl/offload/ledger.py), held to a model.

tiny-llama (the shipped preset, random init) runs 10 steps on each gradient path, through the CUDA
shim (tests/offload/cuda_shim.py ``engine_on_shim``: the CUDA branches of the transfers, on CPU
memory), so the waits a GPU run writes are counted too. Each step's ``StepStats.bytes`` must equal
:func:`expected_bytes` and its ``StepStats.waits`` :func:`expected_waits`: small formulas of what
kind of step it is and of layout facts the test computes itself (matrix elements on the host,
the device-owned columns' elements, the model's itemsize, the columns a selection moved), never
the engine's own totals. A step that moves a byte more or writes one wait more fails. Plants
seen failing it: the fused CPU update counting one gradient slot instead of each of the
interval's (ledger.py ``count_adamw_sum``: step 4's bytes), the bound on gradient temporaries in
flight removed from the copy stream (stream.py ``_make_room``: step 3's waits).

The schedule (full_warm_up_rounds 2, update_interval 3, select_interval 6, overlap):

    step  0 1  2          3         4         5         6         7        8          9
    kind  warm-up x2, selection, ordinary, boundary, ordinary, ordinary, install, selection, ordinary
          (interval-first steps: 0, 1, 2, 5, 8; step 7 ends its interval early: 8 selects)

A selection does not drain the pipeline (selector.py): step 8 meets the update step 7 submitted,
waits for its entering columns only (``host.priority``), installs nothing (that update installs
at the next boundary) and moves the state by asynchronous DMA (migration.py), whose leaving rows
the worker writes behind the update, charged to step 8.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from cuda_shim import engine_on_shim, fake_cuda
from test_offload_helpers import zen

from zfctl.offload import ZenFlowOptimizer, vocab_matrices
from zfctl.offload.ledger import BYTE_KINDS, WAIT_KINDS, Ledger, Tab
from zfctl.offload.stats import StepStats

W, U, SELECT, STEPS = 2, 3, 6, 10
SCALARS = 8  # the norm and the clip factor, one fp32 each (no auto interval: no masses)
# Per step: what it does beyond landing its gradient ("submit": ends an interval and hands it to
# the CPU worker; "install": an update's columns go into the params; "select": a selection), and
# whether it starts an interval (its gradient writes the sum instead of adding to it).
SCHEDULE: list[tuple[frozenset[str], bool]] = [
    (frozenset({"submit", "install"}), True),  # 0 warm-up: synchronous, an interval of one step
    (frozenset({"submit", "install"}), True),  # 1 warm-up
    (frozenset({"select"}), True),  # 2 the first selection (warm-up left nothing in flight)
    (frozenset(), False),  # 3 ordinary
    (frozenset({"submit"}), False),  # 4 boundary: nothing in flight to install yet
    (frozenset(), True),  # 5 ordinary, the interval's first step
    (frozenset(), False),  # 6 ordinary
    (frozenset({"submit", "install"}), False),  # 7 install: collects step 4's update, submits its own
    (frozenset({"select"}), True),  # 8 selection: step 7's update still in flight, not installed here
    (frozenset(), False),  # 9 ordinary
]
PATHS = {  # zenflow keys of each gradient path, and whether the loop announces its backwards
    "step": ({"accumulate": "host"}, False),  # unannounced: step() lands every matrix
    "hook": ({"accumulate": "host", "release_grads": True}, True),
    "hook-keep": ({"accumulate": "host", "release_grads": False}, True),
    "device": ({"accumulate": "device"}, True),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@dataclass(frozen=True)
class Facts:
    """What the model needs, from the layout and the selections (module docstring)."""

    path: str
    M: int  # matrix elements in host column ranges: what crosses PCIe (whole column ranges travel)
    K: int  # of those, elements of device-owned columns once selected (rows x k per selectable matrix)
    b: int  # the model's bytes per element
    Kc: int  # device-owned columns of the selectable matrices (the selection's id fetch)


def expected_bytes(step: int, f: Facts, moved: tuple[int, ...], spans: int) -> dict[str, int]:
    """The ledger of ``step`` on today's engine; ``moved``: (entering columns, their elements,
    leaving columns, their elements, staying columns that change rows) of the selection at this
    step (zeros elsewhere); ``spans``: elements the device path's copy out moves (each matrix from
    its first host-owned column to its last: tiny-llama's device-owned gaps are all short).

    The host paths land each step's gradient in its own slot and nothing sums it per step: the
    CPU update reads every slot of the interval inside its one AdamW pass (native adamw_sum), so
    ``host.sum`` appears only at a boundary, ``b`` bytes per slot per host-owned element; the
    device path's update reads its one fp32 sum (4 B). The lines the pending engine changes touch
    (so the lead edits them, nowhere else): ``h2d.install`` / ``host.install`` (install:
    host-owned elements only), the migration lines (selection).
    """
    facets, _ = SCHEDULE[step]
    own = f.M - (f.K if step >= W else 0)  # host-owned elements once columns are selected
    # A release step lands its gradient in the hooks, before its selection re-plans the chunks.
    # The upload buffer (upload_buffer: auto): a model narrower than fp32 installs from the copy
    # the CPU AdamW writes in the model's dtype; an fp32 model installs from the master itself.
    upload = f.b if f.b < 4 else 0
    got: Counter[str] = Counter({"d2h.scalars": SCALARS})
    if f.path != "device":
        got["d2h.grad"] = got["host.land"] = f.b * f.M  # the gradient's column ranges, model dtype, into the slot
    if "submit" in facets:
        if f.path == "device":
            got["d2h.sum"] = got["host.land"] = 4 * spans  # the fp32 interval sum's host-owned spans, once
            got["host.sum"] = 4 * own  # the CPU update reads the sum ...
        else:
            got["host.sum"] = f.b * interval_steps(step) * own  # ... or each of the interval's slots ...
        got["host.update"] = (24 + upload) * own  # ... reads + writes master and moments, writes the copy
    if "install" in facets:
        got["h2d.install"] = got["host.install"] = (upload or 4) * f.M  # the install source's column ranges
    if "select" in facets:
        enter, enter_el, leave, leave_el, restay = moved
        # in: master, moments and the step counter of each entering column (in ring, one H2D per slot)
        # out: master and moments of each leaving column (out buffer); their counters came with the ids
        state_in, state_out = 12 * enter_el + 4 * enter, 12 * leave_el
        # released gradients (hook path): fp32 through the in ring and the out buffer, read from and
        # written into the step's slot in the model dtype (migration.py widens and narrows, exactly)
        grad_in, grad_out = (4 * enter_el, 4 * leave_el) if f.path == "hook" else (0, 0)
        slot_in, slot_out = (f.b * enter_el, f.b * leave_el) if f.path == "hook" else (0, 0)
        ids = 8 * (leave + 2 * restay + enter)  # the moves' device rows: leaving, staying (from, to), entering
        fetched = 8 * 2 * f.Kc  # the new column ids and the old counters, fp64, one D2H
        got["h2d.migrate"], got["d2h.migrate"] = state_in + grad_in + ids, state_out + grad_out + fetched
        # host rows gathered (in) and written (out, by the worker), the leaving counters, and the
        # leaving columns' upload entries (a model narrower than fp32)
        got["host.migrate"] = state_in + slot_in + state_out + slot_out + 4 * leave + upload * leave_el
        # page-locked: the in ring written by the gather and read by the DMA, the out buffer written
        # by the DMA and read by the worker, the ids buffer written and read
        got["host.stage"] = 2 * (state_in + grad_in + state_out + grad_out) + 2 * ids
    return {k: v for k, v in got.items() if v}


def interval_steps(step: int) -> int:
    """Steps of the interval that ``step`` ends: slots the CPU update reads (SCHEDULE's first flags)."""
    start = max(t for t in range(step + 1) if SCHEDULE[t][1])
    return step - start + 1


def expected_waits(step: int, f: Facts, chunks: int, mats: int) -> dict[str, int] | None:
    """The waits ``step`` writes on today's engine (docs/design.md, "Transfer scheduling", sync
    points); ``chunks``: column chunks the gradient and the install move; ``mats``: host matrices.
    None for the warm-up (landing buffers and rings still cold). A selection step is
    :func:`selection_waits`."""
    facets, first = SCHEDULE[step]
    if step < W:
        return None
    if "select" in facets:
        return selection_waits(step, f, chunks, mats)
    w: Counter[str] = Counter({"host.scalars": 1})  # the step's scalars
    if f.path != "device":
        # step() or a hook lands each chunk through the copy stream; shim: copies never retire, so
        # each chunk finds the temporaries' budget full. Nothing else: no slot is waited for (two
        # sets) and nothing sums on the host per step.
        w["host.hook_budget"] = chunks
    elif first:
        w["device.sum_copy"] = mats  # the first add into each matrix waits for its copy out (device)
    if "install" in facets:
        w["host.cpu_update"] = 1  # collect: the update in flight
        # No module hooks attached here (install.py): the compute stream waits for the whole install
        # once, device-side, at install time; the install stream waits for each chunk's H2D.
        w["device.install"] = 1
    if "submit" in facets:
        # the worker waits for the interval's gradient: the last copy into a slot, or on the device
        # path each matrix's copy out, just before that matrix's part
        w["worker.grads"] = mats if f.path == "device" else 1
        if install_in_flight(step, upload=f.b < 4):
            w["worker.install"] = 1  # ... and for the install DMA still reading what it writes
    return dict(w)


def selection_waits(step: int, f: Facts, chunks: int, mats: int) -> dict[str, int]:
    """The waits of a selection step: no drain, so no ``host.cpu_update``, no install and no
    install wait; the training thread waits once for the new column ids (``host.migrate_ids``),
    for the entering part of the update in flight and the worker's fill of the in ring after it
    (``host.priority``; the first selection meets no update: ``host.migrate_fill``), and on the release path for the copies into the step's slot
    (``host.slot_drain``: the moves read it) and the leaving gradient's one out piece
    (``host.migrate_land``). The compute stream waits for the migration (``device.migrate``); the
    worker, behind the update, for the out piece holding the state and, after an install, that
    install's DMA (``worker.migrate``). The gradient's own waits are an ordinary step's."""
    first = SCHEDULE[step][1]
    w: Counter[str] = Counter({"host.scalars": 1, "host.migrate_ids": 1, "device.migrate": 1})
    if f.path != "device":
        w["host.hook_budget"] = chunks  # the gradient's chunks into the step's slot, as every step
    elif first:
        w["device.sum_copy"] = mats
    # The worker's fill of the in ring (migration.py): inside the update in flight's priority
    # wait at step 8, a wait of its own at the first selection, which meets no update.
    w["host.priority" if step > W else "host.migrate_fill"] = 1
    # the state's leaving rows go out in one piece (tiny-llama: far below 64 MiB); the first
    # selection has none. The worker waits for an install's DMA first if no submit consumed it.
    if step > W:
        w["worker.migrate"] = 1 + install_in_flight(step, upload=f.b < 4)
    if f.path == "hook":
        w["host.slot_drain"] = 1  # the release path's moves read the step's slot (optimizer.py _reselect)
        if step > W:
            w["host.migrate_land"] = 1  # the leaving gradient's one out piece (selector.py land)
    return dict(w)


def install_in_flight(step: int, *, upload: bool) -> bool:
    """Whether an install's DMA fence is still unconsumed when ``step`` submits (HostState.install_fence).

    An install sets the fence; the next submit consumes it (the worker writes the install source
    after it). A selection does not: its leaving rows are written behind the update, after that
    fence, taken by value (migration.py ``Departure``), whatever the install source (``upload``).
    A warm-up step installs after its synchronous submit; later steps collect (install) before
    they submit."""
    fence = False
    for t, (facets, _) in enumerate(SCHEDULE[: step + 1]):
        if "install" in facets and t >= W:
            fence = True
        if t == step:
            return fence
        if "submit" in facets:
            fence = False
        if "install" in facets and t < W:
            fence = True
    raise AssertionError("unreachable")


def run(path: str, monkeypatch, dtype: str = "fp32"):
    """STEPS steps of tiny-llama on ``path`` through the shim: (stats, layout facts, chunks,
    the selection's moved columns per step)."""
    from zfctl.plan import resolve_plan
    from zfctl.train.models.load import load_model

    keys, announce = PATHS[path]
    plan = resolve_plan("tiny-llama", "alpaca-sample")
    model = load_model(plan.model, precision=dtype, device=torch.device("cpu"), seed=0)
    cfg = zen(topk_ratio=0.1, update_interval=U, select_interval=SELECT, full_warm_up_rounds=W, overlap_step=True,
              **keys)
    ids = torch.randint(0, 4096, (STEPS, 1, 8), generator=torch.Generator().manual_seed(1))
    stats: list[StepStats] = []
    moved: list[tuple[int, ...]] = []
    spans: list[int] = []
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-3, vocab_params=vocab_matrices(model)) as opt:
        fake_cuda(monkeypatch)
        engine_on_shim(opt)
        slots = opt.layout.host_slots
        for i in range(STEPS):
            before = [opt.device_state.index[s.index] for s in slots]
            opt.zero_grad(set_to_none=True)
            if announce:
                opt.prepare_backward(final=True)
            model(input_ids=ids[i], labels=ids[i]).loss.backward()
            stats.append(opt.step())
            after = [opt.device_state.index[s.index] for s in slots]
            moved.append(columns_moved(slots, before, after))
            spans.append(host_spans(slots, after))
        chunks = len(opt.transfers.chunks)
        opt.flush()  # the last helper-thread work is charged to its step: read the ledger after this
    b = torch.finfo(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])).bits // 8
    facts = Facts(path, M=opt.layout.host_numel, K=sum(s.rows * s.k for s in slots if s.selects), b=b,
                  Kc=sum(s.k for s in slots if s.selects))
    return stats, facts, chunks, len(slots), moved, spans


def columns_moved(slots, before, after) -> tuple[int, ...]:
    """(entering columns, their elements, leaving columns, their elements, staying columns whose
    device row changes) between two selections."""
    enter = enter_el = leave = leave_el = restay = 0
    for s, old, new in zip(slots, before, after):
        old_l = [] if old is None else old.tolist()
        new_l = [] if new is None else new.tolist()
        old_set, new_set = set(old_l), set(new_l)
        enter, enter_el = enter + len(new_set - old_set), enter_el + len(new_set - old_set) * s.rows
        leave, leave_el = leave + len(old_set - new_set), leave_el + len(old_set - new_set) * s.rows
        if old_l != new_l:
            restay += sum(old_l.index(c) != new_l.index(c) for c in old_set & new_set)
    return enter, enter_el, leave, leave_el, restay


def host_spans(slots, index) -> int:
    """Elements from each matrix's first host-owned column to its last (all, before a selection)."""
    total = 0
    for s, idx in zip(slots, index):
        dev = set() if idx is None else set(idx.tolist())
        host = [c for c in range(s.cols) if c not in dev]
        total += s.rows * (host[-1] - host[0] + 1) if host else 0
    return total


def check(stats, facts, chunks, mats, moved, spans) -> None:
    for t, s in enumerate(stats):
        facets, _ = SCHEDULE[t]
        # the step is the kind the schedule says (an early install or a stray selection shows here)
        assert (s.warmup, s.selection, s.boundary, s.installed) == (
            t < W, "select" in facets, "submit" in facets, "install" in facets), t
        assert set(s.bytes) <= set(BYTE_KINDS) and not any(k.endswith("unlabelled") for k in s.bytes), s.bytes
        assert s.bytes == expected_bytes(t, facts, moved[t], spans[t]), f"step {t} ({sorted(facets)}): bytes"
        want = expected_waits(t, facts, chunks, mats)
        if want is not None:
            assert s.waits == want, f"step {t} ({sorted(facets)}): waits"
        assert s.d2h_bytes == sum(v for k, v in s.bytes.items() if k.startswith("d2h."))
        assert s.host_bytes == sum(v for k, v in s.bytes.items() if k.startswith("host."))


@pytest.mark.parametrize("path", list(PATHS))
def test_each_step_moves_the_modelled_bytes_and_writes_the_modelled_waits(path, monkeypatch) -> None:
    stats, facts, chunks, mats, moved, spans = run(path, monkeypatch)
    assert moved[W][0] > 0 and moved[W][2] == 0  # the first selection: every device column enters
    assert moved[W + SELECT][0] == moved[W + SELECT][2]  # later ones swap columns one for one
    check(stats, facts, chunks, mats, moved, spans)


@pytest.mark.slow
def test_the_ledger_of_a_bf16_model(monkeypatch) -> None:
    """2 B per element of gradient: the gradient lines follow the model's itemsize, the fp32
    state and install lines do not."""
    stats, facts, chunks, mats, moved, spans = run("hook", monkeypatch, dtype="bf16")
    assert facts.b == 2
    check(stats, facts, chunks, mats, moved, spans)


def test_work_on_a_helper_thread_is_charged_to_the_step_that_issued_it() -> None:
    """A job issued in one step and run after the step closed still counts into that step."""
    ledger = Ledger()
    job = ledger.charged(lambda: ledger.moved("host.sum", 7))
    ledger.moved("d2h.grad", 3)
    first = ledger.close()
    ledger.waited("host.scalars")
    worker = threading.Thread(target=job)
    worker.start()
    worker.join()
    second = ledger.close()
    assert first.bytes == {"d2h.grad": 3, "host.sum": 7} and first.waits == {}
    assert second.bytes == {} and second.waits == {"host.scalars": 1}


def test_an_unlisted_kind_is_refused_and_untyped_bytes_are_booked_as_unlabelled() -> None:
    tab = Tab()
    with pytest.raises(KeyError, match="BYTE_KINDS"):
        tab.moved("d2h.gradient", 1)
    with pytest.raises(KeyError, match="WAIT_KINDS"):
        tab.waited("host.everything")
    stats = StepStats(step=0, tab=tab)
    stats.d2h_bytes += 5  # code that adds to the total without a kind
    stats.host_bytes += 2
    assert stats.bytes == {"d2h.unlabelled": 5, "host.unlabelled": 2} and stats.d2h_bytes == 5
    assert all(k in BYTE_KINDS for k in stats.bytes) and set(WAIT_KINDS) >= {"host.cpu_update", "device.install"}
