"""The ``carry`` host gradient layout (zfctl/offload/grads/carry.py) against ``slots``: the same bits.

``slots`` keeps each step's gradient in its own slot and sums them inside the CPU AdamW;
``carry`` folds each landed chunk into one fp32 sum as it arrives (``fma(g, u, a)``, the first step
of an interval into +0). Both take ``u`` per step and the interval's mean clip factor at the
boundary (docs/design.md, "Algorithm"), so the two agree bit for bit, clipping on or off: losses, weights, the optimizer state, a checkpoint's interval sum and a resume
from inside an interval. The model has a head that gets no gradient at some steps (also at an
interval's first step: the carry's ``+0``) and, at others, one from the first micro-batch only
(step() lands it); the schedule has selections (with ``release_grads`` the selection moves the
step's gradient columns in and out of the carry) and installs; overlap on (one carry, the next
interval's writes follow the worker, acc_gate.py) and off.
"""

from __future__ import annotations

import io
import math
import time
from typing import Any

import pytest
import torch
from cuda_shim import engine_on_shim, fake_cuda
from test_offload_helpers import batches, snapshot, tiny_net, zen
from test_offload_release import Gated

from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.grads.carry import Folds, GradCarry
from zfctl.offload.grads.slots import GradSlots
from zfctl.offload.sizing import carry_host_bytes
from zfctl.plan import resolve_plan
from zfctl.train.models.load import load_model
from zfctl.train.optim import build_optimizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

STEPS = 14
# Warm-up step 0; selections at 1, 7, 13; intervals [1, 3], [4, 6], [7, 9], [10, 12], [13].
BASE = {"topk_ratio": 0.25, "update_interval": 3, "select_interval": 6, "full_warm_up_rounds": 1}
# The extra head's gradient at step t: GATE[t % 4]. Intervals start at 1 (first micro-batch only),
# 4 and 7 (none: the carry's +0 over the last interval's sum), 10 (the final backward).
GATE = ("none", "first", "final", "none")
ONE_COLUMN = {"ring_slot_mb": 200 / 2**20}  # a chunk per column: regather writes a leaving column itself
PATHS: dict[str, tuple[bool, dict[str, Any]]] = {  # (hooks, config)
    "step-path": (False, {}),
    "hooks": (True, {"release_grads": False}),
    "release": (True, {}),
    "release-sequential": (True, {"overlap_step": False}),
    "release-one-column-chunks": (True, ONE_COLUMN),
    "step-path-sequential": (False, {"overlap_step": False}),
}


def deep(sd: dict) -> dict:
    """A deep copy through torch.save (what a checkpoint holds)."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def train(layout: str, cfg: dict[str, Any], *, hooks: bool, dtype: torch.dtype = torch.float32,
          clip: float | None = None, poison: int | None = None, start: dict | None = None,
          steps: range = range(STEPS), save_at: int | None = None, setup: Any = None) -> dict[str, Any]:
    """Two micro-batches per step (the loop's call pattern). ``poison``: fp16, the step whose loss
    is inf (skipped). ``save_at``: the state after that many steps. ``start``: the state to
    resume from. ``setup``: called with the optimizer before the first step. Returns the
    weights, losses, the final optimizer state and the saved one."""
    torch.manual_seed(0)
    model = Gated().to(dtype)
    if start is not None:
        model.load_state_dict(start["model"])
    config = zen(**{"overlap_step": True, **BASE, **cfg}, grad_layout=layout)
    data, losses, out = batches(STEPS, dtype=dtype), [], {}
    with ZenFlowOptimizer(model.named_parameters(), config, lr=1e-2, weight_decay=0.01, max_grad_norm=clip) as opt:
        assert isinstance(opt.host.grads, GradCarry) == (layout == "carry")
        if setup is not None:
            setup(opt)
        if start is not None:
            opt.load_state_dict(start["opt"])
        for t in steps:
            x, y = data[t]
            opt.zero_grad(set_to_none=True)
            for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
                if hooks:
                    opt.prepare_backward(final=i == 1)
                use = GATE[t % 4] == ("first", "final")[i]
                loss = torch.nn.functional.mse_loss(model(xm, extra=use).float(), ym.float()) / 2
                if t == poison and i == 1:
                    loss = loss * math.inf
                opt.scale_loss(loss).backward()
            stats = opt.step()
            assert stats.skipped == (t == poison)
            losses.append(loss.item())
            if save_at is not None and t + 1 == save_at:
                out["saved"] = deep({"model": model.state_dict(), "opt": opt.state_dict()})
        opt.flush()
        out["state"] = deep(opt.state_dict())
    out["weights"], out["losses"] = snapshot(model), losses
    return out


def same_state(a: Any, b: Any, path: str = "") -> None:
    """Every tensor and number of two optimizer states equal (bits for tensors), but the slot set
    the counters point at (``cur``: two slot sets alternate, the carry is one) and the layout."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            if k not in ("cur", "grad_layout"):
                same_state(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
        if a.is_floating_point():
            assert torch.equal(torch.signbit(a), torch.signbit(b)), path  # -0 is not +0 here
    else:
        assert a == b, path


def same_run(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["losses"] == want["losses"]
    assert all(torch.equal(got["weights"][n], want["weights"][n]) for n in want["weights"])
    same_state(got["state"], want["state"])


@pytest.mark.parametrize("path", list(PATHS))
def test_carry_is_bit_identical_to_slots(path: str) -> None:
    hooks, cfg = PATHS[path]
    want, got = train("slots", cfg, hooks=hooks), train("carry", cfg, hooks=hooks)
    same_run(got, want)
    assert want["losses"][0] != want["losses"][-1]  # it trained


@pytest.mark.parametrize("poison", [4, 5], ids=["first-of-interval", "mid-interval"])
@pytest.mark.parametrize("path", ["step-path", "release"])
def test_an_fp16_overflow_step_folds_nothing(path: str, poison: int) -> None:
    """Under loss scaling the carry lands a step only after its overflow check (the hooks land
    nothing, carry.py): a skipped step adds nothing, as its unrecorded slot does."""
    hooks, cfg = PATHS[path]
    want = train("slots", cfg, hooks=hooks, dtype=torch.float16, poison=poison)
    got = train("carry", cfg, hooks=hooks, dtype=torch.float16, poison=poison)
    same_run(got, want)


@pytest.mark.parametrize("path", ["step-path", "release", "release-sequential"])
def test_a_checkpoint_inside_an_interval_holds_the_same_sum_and_resumes(path: str) -> None:
    """Saved after two steps of the interval [4, 6]: the saved fp32 interval sum (``acc``) and
    the whole state are those of the slots layout; resumed under carry (from its own checkpoint
    and from the slots layout's) it goes on bit for bit as the run that did not stop."""
    hooks, cfg = PATHS[path]
    slots = train("slots", cfg, hooks=hooks, save_at=6)
    carry = train("carry", cfg, hooks=hooks, save_at=6)
    assert carry["saved"]["opt"]["counters"]["interval_len"] == 2
    same_state(carry["saved"], slots["saved"])
    same_run(carry, slots)
    for saved in (carry["saved"], slots["saved"]):
        resumed = train("carry", cfg, hooks=hooks, start=saved, steps=range(6, STEPS))
        assert all(torch.equal(resumed["weights"][n], carry["weights"][n]) for n in carry["weights"])
        same_state(resumed["state"], carry["state"])


@pytest.mark.parametrize("path", ["step-path", "release"])
def test_a_slow_cpu_update_is_waited_for_before_the_carry_is_overwritten(path: str) -> None:
    """Overlap with one carry: the worker sleeps before each piece, so the next interval's first
    step reaches the carry while the update still reads it; each overwrite waits until its piece
    was read (acc_gate.py, counted), and the bits are the slots' (two sets: nothing waits)."""
    hooks, cfg = PATHS[path]
    waits: list[int] = []

    def slow(opt: ZenFlowOptimizer) -> None:
        opt.pipeline.worker.before_piece = lambda i: time.sleep(0.005)
        step = opt.step
        opt.step = lambda *a, **k: (s := step(*a, **k), waits.append(s.acc_gate_waits))[0]  # type: ignore[method-assign]

    want = train("slots", cfg, hooks=hooks)
    got = train("carry", cfg, hooks=hooks, setup=slow)
    same_run(got, want)
    assert sum(waits) > 0


def test_the_carry_is_the_partial_sum_a_streamed_save_reads() -> None:
    """``partial_sum_into`` (the streamed save's chunk) copies elements [lo, hi) of the carry: the
    same bits as the slots' chain forms over the same range, whatever the cut."""
    sums = {}
    for layout in ("slots", "carry"):
        model = tiny_net()
        with ZenFlowOptimizer(model.named_parameters(), zen(topk_ratio=0.25, update_interval=4,
                                                            grad_layout=layout)) as opt:
            for x, y in batches(2):
                opt.zero_grad(set_to_none=True)
                opt.prepare_backward(final=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            opt.drain()
            n = opt.layout.host_numel
            whole = torch.empty(n)
            opt.host.grads.partial_sum_into(0, whole, 0, n)
            parts = [torch.empty(hi - lo) for lo, hi in ((0, n // 3), (n // 3, n))]
            opt.host.grads.partial_sum_into(0, parts[0], 0, n // 3)
            opt.host.grads.partial_sum_into(0, parts[1], n // 3, n)
            assert torch.equal(torch.cat(parts), whole)  # a chunk's sum is the whole one's range
            opt.host.canonicalize(whole, fresh=False)  # device-owned rows hold leftovers: nothing reads them
            sums[layout] = whole
    assert torch.equal(sums["carry"], sums["slots"]) and bool(sums["carry"].abs().sum())


def test_carry_is_bit_identical_to_slots_with_clipping() -> None:
    """Under the interval-mean rule both layouts take ``u`` per step (the carry on arrival, the
    slots in adamw_sum's chain) and the same mean clip factor at the boundary."""
    hooks, cfg = PATHS["release"]
    same_run(train("carry", cfg, hooks=hooks, clip=0.05), train("slots", cfg, hooks=hooks, clip=0.05))


def llama_run(layout: str, hooks: bool, overlap: bool, precision: str) -> tuple[list[torch.Tensor], list[float]]:
    """12 steps of tiny-llama on CPU, clipping off: a selection at 2 and 8, intervals of 3;
    ``hooks``: the loop announces each final backward (the hook path), else step() lands."""
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        "train.device=cpu", f"train.precision={precision}", f"zenflow.overlap_step={str(overlap).lower()}",
        "zenflow.full_warm_up_rounds=2", "zenflow.update_interval=3", "zenflow.select_interval=6",
        "train.max_grad_norm=null", f"zenflow.tuning.grad_layout={layout}"])
    model = load_model(plan.model, precision=precision, device=torch.device("cpu"), seed=0)
    gen = torch.Generator().manual_seed(0)
    losses = []
    with build_optimizer(model, plan, steps_per_epoch=100) as opt:
        assert isinstance(opt.host.grads, GradCarry) == (layout == "carry")
        for _ in range(12):
            ids = torch.randint(0, 4096, (2, 32), generator=gen)
            opt.zero_grad(set_to_none=True)
            if hooks:
                opt.prepare_backward(final=True)
            loss = model(input_ids=ids, labels=ids).loss
            opt.scale_loss(loss).backward()
            opt.step()
            losses.append(loss.item())
        opt.flush()
    return [p.detach().clone() for p in model.parameters()], losses


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("hooks", [True, False], ids=["hook-path", "step-path"])
def test_tiny_llama_losses_and_weights_are_the_same_under_carry(hooks: bool, overlap: bool, precision: str) -> None:
    want, got = llama_run("slots", hooks, overlap, precision), llama_run("carry", hooks, overlap, precision)
    assert got[1] == want[1]
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))


def test_the_ledger_counts_the_carry_traffic() -> None:
    """Per chunk: its D2H into a ring slot (``d2h.grad``, ``host.land``), then the fold
    (``host.fold``: the ring slot read, the carry written on an interval's first step, else read
    and written); the CPU update reads the carry, 4 B per element (``host.sum``), never slots."""
    sums = {}
    for layout in ("slots", "carry"):
        model = tiny_net()
        cfg = zen(topk_ratio=0.25, update_interval=3, overlap_step=False, grad_layout=layout)
        with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2) as opt:
            sums[layout] = []
            for t, (x, y) in enumerate(batches(7)):
                first = opt.pipeline.first_of_interval
                opt.zero_grad(set_to_none=True)
                opt.prepare_backward(final=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                stats = opt.step()
                b = stats.bytes
                landed = b["d2h.grad"] // 4  # fp32 elements landed this step
                assert landed > 0 and b["host.land"] == b["d2h.grad"]
                if layout == "carry":
                    assert b["host.fold"] == landed * (4 + (4 if first else 8)), t
                else:
                    assert "host.fold" not in b
                if stats.boundary:
                    sums[layout].append((opt.pipeline.last_interval, b["host.sum"]))
            if layout == "carry":
                n, grads = opt.layout.host_numel, opt.host.grads
                assert carry_host_bytes(n, cfg.tuning.ring_slots, grads.folds.slot_elems * 4) == (
                    grads.carry[0].nbytes + grads.folds.ring.nbytes)
    # The update reads each of the interval's fp32 slots, or the carry once.
    assert len(sums["carry"]) >= 2 and [(u, u * s) for u, s in sums["carry"]] == sums["slots"]


def shim_run(monkeypatch: pytest.MonkeyPatch, layout: str, *, fold_s: float = 0.0, ring_slots: int = 4) -> dict:
    """The release path through the CUDA stand-in (tests/offload/cuda_shim.py): the copy stream's
    branch writes each chunk by a "DMA" into its ring slot, and the carry's fold thread runs,
    waiting for each copy's event; ``fold_s``: each fold sleeps first (a slow fold thread)."""
    waits: dict[str, int] = {}

    def on_shim(opt: ZenFlowOptimizer) -> None:
        fake_cuda(monkeypatch)
        engine_on_shim(opt)
        if isinstance(opt.host.grads, GradCarry):
            opt.host.grads.folds.start()
            if fold_s:
                fold = Folds._fold
                monkeypatch.setattr(Folds, "_fold", lambda self, job: (time.sleep(fold_s), fold(self, job))[1])
        step = opt.step

        def counted(*a: Any, **k: Any) -> Any:
            stats = step(*a, **k)
            for kind, c in stats.waits.items():
                waits[kind] = waits.get(kind, 0) + c
            return stats

        opt.step = counted  # type: ignore[method-assign]

    out = train(layout, {"ring_slots": ring_slots, **ONE_COLUMN}, hooks=True, setup=on_shim)
    monkeypatch.undo()
    out["waits"] = waits
    return out


def test_the_fold_thread_gives_the_same_bits_and_its_waits_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch (fold thread, ring slots freed by folds, the worker's fence on the last
    fold) over the stand-in, with a slow fold thread and a one-slot ring: every chunk's fold
    waits for its copy (``fold.copy``), a hook waits for the ring (``host.ring_full``), and the
    bits are the synchronous slots run's."""
    want = train("slots", {"ring_slots": 1, **ONE_COLUMN}, hooks=True)
    got = shim_run(monkeypatch, "carry", fold_s=0.002, ring_slots=1)
    same_run(got, want)
    assert got["waits"].get("fold.copy", 0) > 0
    assert got["waits"].get("host.ring_full", 0) > 0
    assert got["waits"].get("worker.grads", 0) > 0  # the CPU update's fence: the last fold


def test_a_failed_fold_reaches_the_training_thread() -> None:
    """An exception on the fold thread is raised where the training thread next waits on it."""
    carry = torch.zeros(64)
    folds = Folds(carry, torch.float32, ring_slots=2, slot_bytes=128, pin=False, device=torch.device("cpu"))
    folds.start()
    i, _ = folds.slot(8)
    folds.fold(None, i, 60, 8, 1.0, False)  # elements [60, 68) of a 64-element carry: fails
    with pytest.raises(RuntimeError, match="fold into the carry failed"):
        folds.drain()
    folds.close()


def test_grad_layout_slots_and_auto_build_slots() -> None:
    for layout in ("slots", "auto"):
        model = tiny_net()
        with ZenFlowOptimizer(model.named_parameters(), zen(topk_ratio=0.25, grad_layout=layout)) as opt:
            assert type(opt.host.grads) is GradSlots
