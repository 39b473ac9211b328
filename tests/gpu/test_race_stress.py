"""Race stress: every copy stream is slowed down, or every host reader, so that a missing wait
shows as wrong bits instead of passing by luck.

Tiny test tensors copy in microseconds, so without help every missing wait would still pass.
Two kinds of wait need two kinds of slowness:

* a reader that must wait for a copy: ``pcie.delay_copies`` makes each copy stream spin ~2 ms
  (``torch.cuda._sleep``) before every copy, so the reader comes before the data;
* a writer that must wait for the last reader (a slot set the next interval writes, the one
  host sum of the device path): ``slow_readers`` (tests/offload/slow_readers.py) makes each CPU
  update sleep before it reads, so the writer comes first. A device buffer's next writer is
  tested the same way with a slowed compute stream.

Each test compares a path under that slowness with the same run without it (or with the step()
path), bit for bit. The waits each test covers are named in its docstring, with the place they are
written (docs/design.md, "Threads and buffer ownership"); removing any one of them makes that
test fail on a GPU. The waits that exist on CPU too are also tested there
(tests/offload/test_offload_fences.py).
"""

from __future__ import annotations

import pytest
import torch
from slow_readers import slow_readers
from test_offload_gpu import HP, PATHS, ZEN, loop
from test_offload_helpers import HID, batches, snapshot, tiny_net, zen

from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer
from zfctl.offload.device import pinned
from zfctl.offload.device.pcie import delay_copies
from zfctl.offload.device.ring import Ring

pytestmark = pytest.mark.gpu
DELAY = 3_000_000  # GPU cycles before every copy: ~1.5-2 ms, far longer than a tiny net's step
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture
def slow_copies():
    delay_copies(DELAY)
    yield
    delay_copies(0)


def _run(cfg: ZenFlowConfig, *, dtype, hooks: bool, clip=None, set_to_none=True, steps: int = 16,
         update_s: float = 0.0, layer_waits: bool = False, slow_install: bool = False):
    model = tiny_net(device="cuda", dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        slow_readers(opt, update_s=update_s)
        if layer_waits:
            assert opt.attach_install_waits(model) == 3  # fc1, fc2, head
        if slow_install:
            _slow_install_stream(opt)
        stats = loop(model, opt, batches(steps, dtype=dtype), hooks=hooks, set_to_none=set_to_none)
        opt.flush()
    return snapshot(model), stats


def _slow_install_stream(opt) -> None:
    """The install stream (zfctl/offload/device/install.py) spins ~2 ms before it puts each param's
    device-owned columns back, i.e. before that param's event: a forward that does not wait for
    its layer's event reads the ridden-along stale columns (or, with slow copies, the old ones)."""
    run = opt.installer.run

    def slow_run(ring, chunks, source, params, restore):
        def late_restore(slot):
            torch.cuda._sleep(DELAY)  # on the install stream: deliver runs there
            restore(slot)

        return run(ring, chunks, source, params, late_restore)

    opt.installer.run = slow_run


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


@DTYPES
@pytest.mark.parametrize("release", [True, False], ids=["release", "keep-grads"])
def test_hook_path_under_slow_copies(slow_copies, dtype, release) -> None:
    """Hook path, by-row vocabulary matrices, ``zero_grad(set_to_none=False)``, clipping. Covers:
    the CPU worker waits for the event after the interval's last copy into its slots before it
    reads them (stream.py ``fence``, its wait); the copy reads a fresh temporary, never ``.grad``
    itself (a by-row column range is contiguous already: reading ``.grad`` would race with the
    in-place zero of the next step); with release_grads the freed ``.grad`` (its memory reused by
    the compute stream only after the copy that reads it) and a selection's regather, which
    reads the step's slot after the hooks' copies (optimizer.py ``_reselect``: ``drain``)."""
    cfg = zen(**ZEN, **PATHS["host-hooks"], vocab_select="rows", overlap_step=True, release_grads=release)
    delay_copies(0)
    ref, _ = _run(zen(**ZEN, **PATHS["host-step"], vocab_select="rows", overlap_step=True),
                  dtype=dtype, hooks=False, clip=0.5, set_to_none=False)
    delay_copies(DELAY)
    got, stats = _run(cfg, dtype=dtype, hooks=True, clip=0.5, set_to_none=False)
    assert sum(s.early_chunks > 0 for s in stats) >= 12  # the hooks moved the gradients
    assert _same(ref, got)


@DTYPES
@pytest.mark.parametrize("sets", [1, 2])
def test_slot_sets_with_a_late_reader(dtype, sets) -> None:
    """Hook path, overlap, each CPU update reading late, copies at full speed. Covers: with one
    slot set, each write of the next interval waits until the update has read that piece
    (acc_gate.py, stream.py ``_land``); with two, the next interval writes the other set
    (pipeline.py ``submit``). Against the step() path, the same bits."""
    cfg = zen(**ZEN, **PATHS["host-hooks"], overlap_step=True, host_accumulators=sets)
    ref, _ = _run(zen(**ZEN, **PATHS["host-step"], overlap_step=True), dtype=dtype, hooks=False, clip=0.5)
    got, stats = _run(cfg, dtype=dtype, hooks=True, clip=0.5, update_s=0.02)
    assert sum(s.early_chunks > 0 for s in stats) >= 12
    assert sets == 2 or sum(s.acc_gate_waits for s in stats) > 0  # one set: the writes waited
    assert _same(ref, got)


@DTYPES
def test_one_column_chunks_under_slow_copies(slow_copies, dtype) -> None:
    """Hook path with tiny chunks (many copies in flight per hook, a small in-flight budget) and
    release_grads: each hook waits for the oldest copies beyond the budget (stream.py
    ``_make_room``), the worker for the last one. Slow copies against fast ones, the same bits."""
    cfg = zen(**ZEN, **PATHS["host-hooks"], overlap_step=True, inflight_mb=1e-4, ring_slot_mb=0.0005)
    delay_copies(0)
    ref, _ = _run(cfg, dtype=dtype, hooks=True, clip=0.5)
    delay_copies(DELAY)
    got, stats = _run(cfg, dtype=dtype, hooks=True, clip=0.5)
    assert sum(s.early_chunks > 0 for s in stats) >= 12 and sum(s.budget_waits for s in stats) > 0
    assert _same(ref, got)


@DTYPES
def test_step_path_tiny_chunks_under_slow_copies(slow_copies, dtype) -> None:
    """step() path with tiny chunks, with clipping, so the step's scalars (norm, clip factor)
    differ from step to step. Covers: the CPU worker waits for the last copy into its slots
    (stream.py ``fence``); the scalar fetch's event (ring.py ``fetch``): without it the host reads
    the fetch buffer before the copy landed, i.e. a reused block with an earlier step's
    coefficient, which the step's slot would then carry."""
    cfg = zen(**ZEN, **PATHS["host-step"], ring_slots=1, ring_slot_mb=0.0005)
    delay_copies(0)
    ref, ref_stats = _run(cfg, dtype=dtype, hooks=False, clip=0.05)  # every step clips: coef = 0.05 / norm
    delay_copies(DELAY)
    got, stats = _run(cfg, dtype=dtype, hooks=False, clip=0.05)
    norms = [s.grad_norm for s in stats]
    assert len(set(norms)) == len(norms) and min(norms) > 0.05  # the scalars change every step
    assert norms == [s.grad_norm for s in ref_stats]  # as fetched: the fetch waited for its copy
    assert _same(ref, got)


@DTYPES
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("late", ["copies", "reader", "adds"])
def test_device_path_under_slow_copies_or_reader(slow_copies, monkeypatch, dtype, overlap, late) -> None:
    """Device accumulation. Slow copies cover: the next interval's first write into a matrix's
    rows of the device sum waits (on the device) for that matrix's copy out (device_acc.py
    ``add``); the CPU worker waits for the last copy out before it reads the host sum, and for
    the install's DMA before it writes the master (its fences). A slow CPU update covers: the
    boundary collects the previous update before the new sum lands in the one host sum
    (pipeline.py ``submit``: collect, then ``prepare``). Slow adds (the compute
    stream spins before each step's adds) cover: the copy out waits for the event after the
    interval's last add (device_acc.py ``copy_out``), else it copies the sum without them."""
    from zfctl.offload.grads.device_acc import DeviceAccumulator

    cfg = zen(**ZEN, **PATHS["device"], overlap_step=overlap)
    delay_copies(0)
    ref, _ = _run(cfg, dtype=dtype, hooks=False, clip=0.5)
    delay_copies(DELAY if late == "copies" else 0)
    if late == "adds":
        add = DeviceAccumulator.add

        def late_add(self, *args, **kw):
            torch.cuda._sleep(DELAY)  # compute stream: the adds land late
            add(self, *args, **kw)

        monkeypatch.setattr(DeviceAccumulator, "add", late_add)
    got, stats = _run(cfg, dtype=dtype, hooks=False, clip=0.5, update_s=0.05 if late == "reader" else 0.0)
    assert sum(s.boundary for s in stats) >= 3
    assert _same(ref, got)


@DTYPES
@pytest.mark.parametrize("path", ["host-step", "device"])
@pytest.mark.parametrize("pin", [True, False], ids=["page-locked", "pageable"])
def test_install_under_slow_copies(slow_copies, dtype, path, pin) -> None:
    """Installs, no per-layer hooks. Covers: the install stream waits for each H2D chunk before
    scattering it into the params (ring.py ``h2d``); the compute stream waits for the whole
    install at install time (install.py ``_publish``); page-locked, the CPU worker submitted
    right after an install waits for the install's DMA before it writes the install source the
    DMA reads, the upload buffer (bf16) or the master (fp32) (``HostState.install_fence``, which
    ring.py takes from pinned.py's registry), else the params receive part of the next update.
    On the device path that fence is the only one: the sum's copy out no longer waits for the
    install. Pageable, CUDA stages the source inside each copy call: no fence is needed, and the
    same bits come out."""
    cfg = zen(**ZEN, **PATHS[path], overlap_step=True, pin_memory=pin)
    delay_copies(0)
    ref, _ = _run(cfg, dtype=dtype, hooks=False)
    delay_copies(DELAY)
    got, stats = _run(cfg, dtype=dtype, hooks=False)
    assert sum(s.installed for s in stats) >= 2 and sum(s.device_wait_ms > 0 for s in stats if s.installed) >= 1
    assert _same(ref, got)


@DTYPES
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("late", ["copies", "worker"])
def test_selections_under_slow_copies_or_a_late_worker(slow_copies, monkeypatch, dtype, path, late) -> None:
    """Re-selections every 4 steps, each meeting the CPU update submitted one step earlier
    (selector.py, migration.py). Slow copies cover: the selection's host wait for the column
    ids' D2H (``Mover.fetch``); the in stream's wait, before writing a block's device rows, for
    the out stream to have gathered its leaving rows (``_stay_all``: the out stream is held back
    by its slowed D2Hs); the worker's fill waiting for an in-ring slot's last H2D before it
    gathers into it (``_in_slot``); the compute stream's wait for the in stream's last H2D before
    the device AdamW (``join``); the worker's wait for each leaving piece's D2H before it writes the
    host rows (``Departure.finish``), and for the install's DMA; on the device path the worker's
    per-matrix copy-out waits (``fences``). A late worker (each update sleeps before it
    starts, each leaving-state write sleeps) covers: the selection waits for the entering part
    and the fill after it (worker.py ``wait_request``), the install and the next update wait for the leaving rows (``settle``).
    A 1-row staging makes every selection reuse in-ring slots (``_in_slot``). With slow copies
    the install stream is slowed and the layers wait for their own install (install.py): the
    migration's streams come after the compute stream, which comes after the install's restore
    of the device columns (``wait_all`` in ``_reselect``), and the leaving columns' upload
    entries are written before the next install reads them (``Departure``'s mirror)."""
    from zfctl.offload import sizing
    from zfctl.offload.columns import migration
    from zfctl.offload.cpu import runs

    monkeypatch.setattr(runs, "PIECE_ELEMS", 256)
    cfg = zen(**{**ZEN, "select_interval": 4, "update_interval": 2}, **PATHS[path], overlap_step=True)
    hooks = path == "host-hooks"
    delay_copies(0)
    ref, _ = _run(cfg, dtype=dtype, hooks=hooks, clip=0.5 if not hooks else None)
    monkeypatch.setattr(sizing, "STAGE_BYTES", 4 * HID)
    delay_copies(DELAY if late == "copies" else 0)
    if late == "worker":
        finish = migration.Departure.finish

        def late_finish(self):
            import time

            time.sleep(0.02)
            finish(self)

        monkeypatch.setattr(migration.Departure, "finish", late_finish)
    got, stats = _run(cfg, dtype=dtype, hooks=hooks, clip=0.5 if not hooks else None,
                      update_s=0.02 if late == "worker" else 0.0, layer_waits=late == "copies",
                      slow_install=late == "copies")
    assert sum(s.selection for s in stats) >= 3 and not any(s.installed for s in stats if s.selection)
    assert _same(ref, got)


@DTYPES
@pytest.mark.parametrize("path", ["host-step", "device"])
def test_each_layer_waits_for_its_own_install_under_a_slow_install_stream(slow_copies, dtype, path) -> None:
    """Per-layer install waits (``attach_install_waits``): the copies and the install stream are
    slowed, so each layer's part lands milliseconds after the step that enqueued it, and the
    next forward starts at once. Covers: each module's forward pre-hook waits (on the device) for
    the event after its params' scatter and device-column restore (install.py
    ``_before_forward``); the install stream waits for the compute stream before it scatters
    (``run``'s ``ready``); the next step's device update waits for whatever no layer waited for
    (``wait_all``). Without any of them the forward reads old or stale columns: other bits than
    the same run with the whole-install wait at full speed."""
    cfg = zen(**ZEN, **PATHS[path], overlap_step=True)
    delay_copies(0)
    ref, _ = _run(cfg, dtype=dtype, hooks=False)  # no hooks: the whole install waited for at once
    delay_copies(DELAY)
    got, stats = _run(cfg, dtype=dtype, hooks=False, layer_waits=True, slow_install=True)
    for s in stats:
        s.resolve()  # the last step's device timings (no later step() read them)
    installed = [i for i, s in enumerate(stats) if s.installed]
    assert len(installed) >= 2
    # The forward after an install waited on the device for its layers (counted in that step).
    assert all(stats[i + 1].device_wait_ms > 0 for i in installed if i + 1 < len(stats) and not stats[i].selection)
    assert _same(ref, got)


def test_a_bf16_install_from_the_fp32_master_under_slow_copies(slow_copies) -> None:
    """``upload_buffer: false``: a bf16 install DMAs the page-locked fp32 master (device slots of
    twice the model-dtype size) and rounds on the device; the fence is then the master's, which
    the CPU worker waits for before it writes it. Same bits as the upload buffer's install."""
    cfg = zen(**ZEN, **PATHS["host-step"], overlap_step=True)
    delay_copies(0)
    ref, _ = _run(cfg, dtype=torch.bfloat16, hooks=False)
    delay_copies(DELAY)
    got, stats = _run(zen(**ZEN, **PATHS["host-step"], overlap_step=True, upload_buffer=False),
                      dtype=torch.bfloat16, hooks=False, layer_waits=True)
    assert sum(s.installed for s in stats) >= 2
    assert _same(ref, got)


def test_install_device_slot_waits_for_the_scatter_that_reads_it() -> None:
    """The direct H2D path reuses device slot i for chunk i + slots only after the scatter of
    chunk i has read it: a device-side wait of the copy stream (ring.py ``_freed``). Here the
    scatters (on the current stream: ``h2d`` without ``stream``) are slowed down instead of the
    copies, and every chunk goes through one slot."""
    n, per = 8, 4096
    src = pinned.empty(n * per, torch.float32, pin=True)
    src.copy_(torch.arange(n * per, dtype=torch.float32))
    dst = torch.zeros(n * per, device="cuda")
    ring = Ring(torch.device("cuda"), 1, per * 4, True)

    def deliver(dev: torch.Tensor, i: int) -> None:
        torch.cuda._sleep(DELAY)  # compute stream: a slow reader of the device slot
        dst[i * per : (i + 1) * per].copy_(dev)

    _, fence = ring.h2d(((src[i * per : (i + 1) * per], i) for i in range(n)), deliver)
    assert fence is not None  # a page-locked source: the DMA reads it after h2d returned
    fence.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)
    pinned.release(src)
