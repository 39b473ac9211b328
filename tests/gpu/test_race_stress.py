"""Race stress: every copy stream is slowed down, so a reader that forgot its wait reads a
destination before the copy has landed, and the bits come out wrong.

Tiny test tensors copy in microseconds, so without help every missing wait would still pass.
``pcie.delay_copies`` makes each copy stream spin ~2 ms (``torch.cuda._sleep``) before every
copy; each test runs a path with that delay and compares it bit for bit with the same run
without it (or with the step() path). The waits each test covers are named in its docstring,
with the place they are written (docs/design.md, "Threads and buffer ownership"); removing any
one of them makes that test fail. The waits that guard a buffer against a *later writer* (a
device slot the next copy reuses) need the reader delayed instead: those tests drive the ring
directly and delay the compute stream.
"""

from __future__ import annotations

import pytest
import torch
from test_offload_gpu import HP, PATHS, ZEN, loop
from test_offload_helpers import batches, snapshot, tiny_net, zen

from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer, pinned
from zfctl.offload.pcie import delay_copies
from zfctl.offload.ring import Ring

pytestmark = pytest.mark.gpu
DELAY = 3_000_000  # GPU cycles before every copy: ~1.5-2 ms, far longer than a tiny net's step
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture
def slow_copies():
    delay_copies(DELAY)
    yield
    delay_copies(0)


def _run(cfg: ZenFlowConfig, *, dtype, hooks: bool, clip=None, set_to_none=True, steps: int = 16):
    model = tiny_net(device="cuda", dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        stats = loop(model, opt, batches(steps, dtype=dtype), hooks=hooks, set_to_none=set_to_none)
        opt.flush()
    return snapshot(model), stats


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


@DTYPES
@pytest.mark.parametrize("clip", [None, 0.5], ids=["coef-known", "clip"])
def test_hook_path_under_slow_copies(slow_copies, dtype, clip) -> None:
    """Hook path, by-row vocabulary matrices, ``zero_grad(set_to_none=False)``. Covers: the
    accumulation thread waits for each chunk's copy event before reading the landing buffer
    (stream.py ``_add``); a window's hooks wait for the jobs that still read its landing buffer
    (``fences``); the copy reads a fresh temporary, never ``.grad`` itself (a by-row column range
    is contiguous already: reading ``.grad`` would race with the in-place zero of the next step);
    the CPU worker waits for the interval's last accumulation job (its fence). With the clip,
    without release_grads (its interval mean clip differs from the step() path by design); without
    it, with release_grads: the landing ring's slots and the freed ``.grad``."""
    cfg = zen(**ZEN, **PATHS["host-hooks"], vocab_select="rows", overlap_step=True, release_grads=clip is None)
    delay_copies(0)
    ref, _ = _run(zen(**ZEN, **PATHS["host-step"], vocab_select="rows", overlap_step=True),
                  dtype=dtype, hooks=False, clip=clip, set_to_none=False)
    delay_copies(DELAY)
    got, stats = _run(cfg, dtype=dtype, hooks=True, clip=clip, set_to_none=False)
    assert sum(s.early_chunks > 0 for s in stats) >= 12  # the hooks moved the gradients
    assert _same(ref, got)


@DTYPES
def test_release_landing_ring_under_slow_copies(slow_copies, dtype) -> None:
    """release_grads with a two-slot landing ring of tiny slots and a clip: every chunk reuses a
    slot. Covers: a hook waits for the job that still adds what its slot held (stream.py
    ``_landing_view``, ``ring_fences``), each job for its chunk's copy event, a selection's
    regather for the queued jobs (optimizer.py ``_reselect``). Slow copies against fast ones,
    the same bits."""
    cfg = zen(**ZEN, **PATHS["host-hooks"], overlap_step=True, inflight_mb=1e-4, ring_slot_mb=0.0005)
    delay_copies(0)
    ref, _ = _run(cfg, dtype=dtype, hooks=True, clip=0.5)
    delay_copies(DELAY)
    got, stats = _run(cfg, dtype=dtype, hooks=True, clip=0.5)
    assert sum(s.early_chunks > 0 for s in stats) >= 12
    assert _same(ref, got)


@DTYPES
def test_step_path_one_ring_slot_under_slow_copies(slow_copies, dtype) -> None:
    """step() path through one tiny ring slot: every chunk reuses it. Covers: the host waits for a
    chunk's copy event before it accumulates the slot, and before the next chunk refills it
    (ring.py ``d2h``); the scalar fetch's event (``fetch``)."""
    cfg = zen(**ZEN, **PATHS["host-step"], ring_slots=1, ring_slot_mb=0.0005)
    delay_copies(0)
    ref, _ = _run(cfg, dtype=dtype, hooks=False)
    delay_copies(DELAY)
    got, _ = _run(cfg, dtype=dtype, hooks=False)
    assert _same(ref, got)


@DTYPES
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
def test_device_path_under_slow_copies(slow_copies, dtype, overlap) -> None:
    """Device accumulation. Covers: the next interval's first write into a matrix's rows of the
    device sum waits (on the device) for that matrix's copy out (device_acc.py ``add``); the CPU
    worker waits for the last copy out before it reads the host accumulator (its fence); the
    boundary collects the previous update before the sum lands in the one host accumulator."""
    cfg = zen(**ZEN, **PATHS["device"], overlap_step=overlap)
    delay_copies(0)
    ref, _ = _run(cfg, dtype=dtype, hooks=False, clip=0.5)
    delay_copies(DELAY)
    got, stats = _run(cfg, dtype=dtype, hooks=False, clip=0.5)
    assert sum(s.boundary for s in stats) >= 3
    assert _same(ref, got)


@DTYPES
@pytest.mark.parametrize("pin", [True, False], ids=["page-locked", "pageable"])
def test_install_under_slow_copies(slow_copies, dtype, pin) -> None:
    """Installs. Covers: the compute stream waits for each H2D chunk before scattering it into
    the params (ring.py ``h2d``, ``timed_wait``); the CPU worker, submitted right after an install,
    waits for the install's DMA before it writes the master it reads (``HostState.install_fence``),
    else the params would receive the next update's values; without page-locking, a host slot is
    refilled only after its previous copy."""
    cfg = zen(**ZEN, **PATHS["host-step"], overlap_step=True, pin_memory=pin)
    delay_copies(0)
    ref, _ = _run(cfg, dtype=dtype, hooks=False)
    delay_copies(DELAY)
    got, stats = _run(cfg, dtype=dtype, hooks=False)
    assert sum(s.installed for s in stats) >= 2 and sum(s.device_wait_ms > 0 for s in stats if s.installed) >= 1
    assert _same(ref, got)


def test_install_device_slot_waits_for_the_scatter_that_reads_it() -> None:
    """The direct H2D path reuses device slot i for chunk i + slots only after the scatter of
    chunk i has read it: a device-side wait of the copy stream (ring.py ``_freed``). Here the
    scatters are slowed down instead of the copies, and every chunk goes through one slot."""
    n, per = 8, 4096
    src = pinned.empty(n * per, torch.float32, pin=True)
    src.copy_(torch.arange(n * per, dtype=torch.float32))
    dst = torch.zeros(n * per, device="cuda")
    ring = Ring(torch.device("cuda"), 1, per * 4, True, host_slots=False)

    def deliver(dev: torch.Tensor, i: int) -> None:
        torch.cuda._sleep(DELAY)  # compute stream: a slow reader of the device slot
        dst[i * per : (i + 1) * per].copy_(dev)

    _, fence = ring.h2d(((src[i * per : (i + 1) * per], i) for i in range(n)), deliver)
    fence.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)
    pinned.release(src)
