"""The hook path (offload/stream.py): gradients leave during the last backward of a step and land
in the step's slot (slots.py) off step(); the parameters are bit-identical to the step() path."""

from __future__ import annotations

import io
import math

import pytest
import torch
from test_offload_helpers import batches, snapshot, tiny_net, zen

from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer

HP = {"lr": 1e-2, "weight_decay": 0.01}
BASE = {"topk_ratio": 0.1, "update_interval": 3, "select_interval": 6}


def run(model, opt, data, *, hooks: bool, micro: int = 2) -> list:
    """Gradient accumulation over ``micro`` micro-batches per step (the loop's call pattern)."""
    out = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            loss = torch.nn.functional.mse_loss(model(xs).float(), ys.float()) / micro
            if hooks:
                opt.prepare_backward(final=i == micro - 1)
            opt.scale_loss(loss).backward()
        out.append(opt.step())
    return out


def train(cfg: ZenFlowConfig, *, hooks: bool, steps: int = 14, dtype=torch.float32, clip=None):
    model = tiny_net(dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        stats = run(model, opt, batches(steps, dtype=dtype), hooks=hooks)
        opt.flush()
    return snapshot(model), stats


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["coef-known", "clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("release", [True, False], ids=["release", "keep-grads"])
def test_hook_path_is_bit_identical_to_step_path(overlap, clip, dtype, release) -> None:
    cfg = zen(overlap_step=overlap, full_warm_up_rounds=1, release_grads=release, **BASE)
    ref, ref_stats = train(cfg, hooks=False, dtype=dtype, clip=clip)
    got, stats = train(cfg, hooks=True, dtype=dtype, clip=clip)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    keys = ("boundary", "selection", "installed", "grad_norm", "d2h_bytes", "h2d_bytes")
    # release_grads: a selection step on the hook path also brings the entering columns' gradient
    # back from the step's slot and sends the leaving ones' to it (release.py regather)
    moved = [(s.d2h_bytes - r.d2h_bytes, s.h2d_bytes - r.h2d_bytes) for r, s in zip(ref_stats, stats)]
    assert all(m == (0, 0) for m, s in zip(moved, stats) if not s.selection or not release)
    assert all(m[1] > 0 for m, s in zip(moved, stats) if s.selection and release)
    keys = keys[:4]
    assert [[getattr(s, k) for k in keys] for s in ref_stats] == [[getattr(s, k) for k in keys] for s in stats]
    assert sum(s.boundary for s in stats) >= 4 and sum(s.selection for s in stats) >= 2


@pytest.mark.slow
def test_auto_interval_announced_or_not_gives_the_same_bits() -> None:
    """``update_interval: auto``: the hook path (announced backwards) lands early and gives the
    step() path's bits (a loop that announces none: no chunk leaves early)."""
    cfg = zen(topk_ratio=0.2, update_interval="auto", auto_ratio=0.5)
    ref, ref_stats = train(cfg, hooks=False, clip=1.0)
    got, stats = train(cfg, hooks=True, clip=1.0)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    assert all(s.early_chunks == 0 for s in ref_stats) and any(s.early_chunks for s in stats)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["coef-known", "clip"])
@pytest.mark.parametrize("release", [True, False], ids=["release", "keep-grads"])
def test_step_leaves_no_gradient_work_for_itself(clip, release) -> None:
    """The CPU-testable property: with the hook path, step() copies no gradient chunk itself;
    every chunk left during backward, clipped or not (the unscale goes with the slot and the clip
    factor with the interval, not with the copy). A selection step without release re-plans the chunks: step() lands it."""
    cfg = zen(overlap_step=True, release_grads=release, **BASE)
    _, ref = train(cfg, hooks=False, clip=clip)
    _, stats = train(cfg, hooks=True, clip=clip)
    for r, s in zip(ref, stats):
        if s.selection and not release:  # a re-selection re-plans the chunks: that step takes the step() path
            assert s.in_step_chunks == r.in_step_chunks > 0 and s.early_chunks == 0
            continue
        assert s.in_step_chunks == 0 and s.early_chunks > 0
        if not s.selection:  # a released selection lands by the old plan, the step() path by the new
            assert s.early_chunks == r.in_step_chunks and s.early_bytes == r.in_step_bytes


def test_only_the_final_backward_streams() -> None:
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), zen(**BASE), **HP) as opt:
        run(model, opt, batches(1, seed=3), hooks=True)  # step 0 selects (the step() path)
        (x, y), = batches(1)
        opt.zero_grad(set_to_none=True)
        opt.prepare_backward(final=False)
        torch.nn.functional.mse_loss(model(x), y).backward()
        assert not opt.gradient_path.stream.landed  # gradients are not final yet: nothing moved
        opt.prepare_backward(final=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        assert opt.gradient_path.stream.landed
        stats = opt.step()
    assert stats.early_chunks > 0 and stats.in_step_chunks == 0


def test_fp16_overflow_drops_the_streamed_gradient() -> None:
    """The landed raw gradient of a skipped step is not recorded: the next step lands in the same
    slot, and the interval counts only the steps taken (the sums: tests/offload/test_offload_slots.py)."""
    model = tiny_net(dtype=torch.float16)
    cfg = zen(**BASE)
    data = batches(6, dtype=torch.float16)
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-3) as opt:
        run(model, opt, data[:4], hooks=True)
        used, slot = opt.host.grads.used(opt.pipeline.cur), opt.pipeline.slot()
        x, y = data[4]
        opt.zero_grad(set_to_none=True)
        opt.prepare_backward(final=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        opt.scale_loss(loss * math.inf).backward()
        stats = opt.step()
        assert stats.skipped and stats.early_chunks == 0
        assert opt.host.grads.used(opt.pipeline.cur) == used and opt.pipeline.slot().data_ptr() == slot.data_ptr()
        assert not run(model, opt, data[5:], hooks=True)[0].skipped
        assert opt.host.grads.used(opt.pipeline.cur) == used + 1


@pytest.mark.parametrize("stop", [4, 5])
def test_resume_with_accumulation_in_flight_is_bit_identical(stop: int) -> None:
    cfg, data = zen(overlap_step=True, **BASE), batches(12)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
        run(model, opt, data, hooks=True)
    expected = snapshot(model)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
        run(model, opt, data[:stop], hooks=True)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model = tiny_net(seed=7)
    model.load_state_dict(saved["model"])
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
        opt.load_state_dict(saved["opt"])
        run(model, opt, data[stop:], hooks=True)
    got = snapshot(model)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_a_second_final_backward_is_refused() -> None:
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), zen(**BASE), **HP) as opt:
        run(model, opt, batches(1, seed=3), hooks=True)
        (x, y), = batches(1)
        opt.prepare_backward(final=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match="announces ONE backward"):
            torch.nn.functional.mse_loss(model(x), y).backward()


@pytest.mark.parametrize("hooks", [False, True], ids=["step-path", "hook-path"])
def test_a_step_without_a_gradient_adds_nothing(hooks: bool) -> None:
    """A matrix without a gradient at a step writes -0.0 into its chunks of the slot (stream.py
    ``_fill``), which the worker's fma chain adds as nothing, at an interval's first step as at
    any other: the same bits as that matrix getting an all-zero gradient. Steps 6 and 7 (the
    first and second step of the interval [6, 8]) leave ``fc2.weight`` without one; the slots of
    set 0 held older intervals' gradients there."""
    cfg = zen(overlap_step=True, **BASE)  # intervals [0,2], [3,5], [6,8]: set 0 again at 6

    def go(hook_path: bool, zeros: bool):
        model = tiny_net()
        with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
            for t, (x, y) in enumerate(batches(10)):
                opt.zero_grad(set_to_none=True)
                model.fc2.weight.requires_grad_(t not in (6, 7))
                if hook_path:
                    opt.prepare_backward(final=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                model.fc2.weight.requires_grad_(True)
                if zeros and t in (6, 7):
                    model.fc2.weight.grad = torch.zeros_like(model.fc2.weight)
                opt.step()
            opt.flush()
        return snapshot(model)

    ref, got = go(hooks, zeros=True), go(hooks, zeros=False)
    assert all(torch.equal(ref[n], got[n]) for n in ref)


class _Copy:
    """A stand-in for a CUDA copy event: not done until someone waits for it."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def test_the_inflight_budget_counts_the_previous_steps_copies() -> None:
    """At 7B the D2H of one step can outlast the next step's forward: its temporaries are still
    in flight when the next backward's hooks start, and the cap must count them (it is not reset
    per step), waiting for the oldest copies first."""
    cfg = zen(**BASE, accumulate="host", inflight_mb=1e-3)  # a cap of 1048 bytes
    with ZenFlowOptimizer(tiny_net().named_parameters(), cfg, **HP) as opt:
        stream = opt.gradient_path.stream
        assert stream is not None and stream.budget_bytes == int(1e-3 * 2**20)
        old, older = _Copy(), _Copy()
        stream.inflight.extend([(older, 600), (old, 400)])  # the last step's copies, still running
        stream.inflight_bytes = 1000
        opt.prepare_backward(final=True)  # a new window: those copies still count
        assert stream.inflight_bytes == 1000 and len(stream.inflight) == 2
        stream._make_room(300)  # 1000 + 300 > 1048: wait for the oldest copy, no more
        assert older.waited and not old.waited
        assert stream.inflight_bytes == 400 and stream.budget_waits == 1


def test_the_cpu_worker_binds_the_optimizer_device(monkeypatch) -> None:
    """The CPU worker waits for CUDA events (the last copy into the slots, the install); it binds
    itself to the optimizer's device as its pool's initializer, before any job (else a context on
    GPU 0 per rank, pcie.bind_device). No other helper thread exists: nothing runs on the host
    per step."""
    import threading

    from zfctl.offload.cpu import worker as worker_mod

    bound: list[tuple[str, torch.device]] = []

    def record(device: torch.device) -> None:
        bound.append((threading.current_thread().name, device))

    monkeypatch.setattr(worker_mod, "bind_device", record)
    cfg = zen(**BASE, accumulate="host", overlap_step=True, release_grads=False)
    model = tiny_net()
    before = {t.name for t in threading.enumerate()}
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=1.0, **HP) as opt:
        run(model, opt, batches(6), hooks=True)
        started = {t.name.split("_")[0] for t in threading.enumerate()} - {n.split("_")[0] for n in before}
    assert {name.split("_")[0] for name, _ in bound} == {"zenflow-cpu"}
    assert {d for _, d in bound} == {torch.device("cpu")}
    assert "zenflow-acc" not in started


def test_a_matrix_whose_gradient_came_from_an_earlier_micro_batch_is_not_lost() -> None:
    """A matrix used in the first micro-batch of a step and not in the last has a ``.grad`` but no
    hook in the final backward: step() lands it itself, and the result equals the step() path."""

    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.side, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)

        def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
            h = torch.tanh(self.fc1(x))
            return self.head(h + torch.tanh(self.side(h)) if use_side else h)

    def train_branchy(hooks: bool):
        torch.manual_seed(0)
        model = Branchy()
        cfg = zen(**BASE, accumulate="host", full_warm_up_rounds=1, release_grads=False)
        with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=0.5, **HP) as opt:
            stats = []
            for x, y in batches(10):
                opt.zero_grad(set_to_none=True)
                for i, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
                    if hooks:
                        opt.prepare_backward(final=i == 1)
                    (torch.nn.functional.mse_loss(model(xs, use_side=i == 0), ys) / 2).backward()
                stats.append(opt.step())
            opt.flush()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, stats

    ref, _ = train_branchy(hooks=False)
    got, stats = train_branchy(hooks=True)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    streamed = [s for s in stats if not s.selection]
    assert all(s.in_step_chunks > 0 and s.early_chunks > 0 for s in streamed)  # side landed in step()
