"""The host paths' per-step gradient slots (zfctl/offload/grads/slots.py) against the arithmetic they
stand for.

Before the slots, the host summed each step's gradient columns into an fp32 accumulator as they
arrived, ``acc = fma(u_t, g_t, acc)`` (the interval's first step into +0; ``u_t`` the fp16
unscale, or 1), and the CPU update ran AdamW on ``acc * (sum_t k_t / n) / n`` (the interval-mean
clip rule, ``k_t`` each step's clip factor: docs/design.md, "Algorithm", step 5). The reference
below is that arithmetic, written out: a hook registered before the optimizer's copies every
final gradient, a wrapper keeps each step's unscale and clip factor, and the reference run's CPU
worker replaces the engine's interval (its slots and its ``grad_scale``) by an fp32 sum of those
copies built with the native ``accumulate`` and the factor computed here, then calls
``adamw_step`` on it. Everything else (the device update, selection, overlap, installs) is the
engine's own in both runs, so the comparison is bit for bit: a wrong gradient, unscale, clip
factor, order or skipped step in a slot shows.

The model has a parameter that gets no gradient at some steps and, at others, one from the first
micro-batch only (its hook does not fire in the final backward), so the cases cover the slot's
``-0.0`` fill and the gradients step() lands itself; selection steps (with ``release_grads`` the
hooks' ``regather`` reads the step's slot), fp16 overflow skips, one and two slot sets, and a
checkpoint taken inside an interval and resumed (its ``acc``, the carry).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from test_offload_helpers import batches, snapshot, zen
from test_offload_release import Gated

from zfctl import _native
from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.cpu.worker import CpuUpdate, CpuWorker
from zfctl.offload.grads.scaler import GradientScale
from zfctl.offload.layout import as_matrix

STEPS = 14
BASE = {"topk_ratio": 0.25, "update_interval": 3, "select_interval": 6, "full_warm_up_rounds": 1}


class Today:
    """The per-step accumulation the slots replaced, fed from copies of the final gradients."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.latest: dict[str, torch.Tensor] = {}  # this step's final gradients, by name
        self.current: dict[str, torch.Tensor] = {}  # those of the step step() is running
        self.steps: list[tuple[dict[str, torch.Tensor], float, float]] = []  # the interval's earlier steps
        self.unscale, self.clip = 1.0, None  # u and k of the step step() is running (k: a device tensor)
        self.sums: dict[int, tuple[torch.Tensor, float]] = {}  # id(CpuUpdate) -> (its fp32 sum, grad_scale)
        self.submitted = 0
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda q, name=name: self.latest.__setitem__(name, q.grad.clone()))

    def this_step(self) -> tuple[dict[str, torch.Tensor], float, float]:
        return self.current, self.unscale, 1.0 if self.clip is None else float(self.clip.item())

    def interval_sum(self, opt: ZenFlowOptimizer) -> tuple[torch.Tensor, float]:
        """``acc`` as the old host path built it: per step, per host matrix, ``fma(u, g, acc)``
        (the first step overwrites: into +0), a matrix without a gradient adds nothing; and the
        update's ``grad_scale``, ``(sum_t k_t / n) / n``."""
        steps, self.steps = [*self.steps, self.this_step()], []
        n = len(steps)
        grad_scale = sum(k for _, _, k in steps) / n / n
        acc = torch.full((opt.layout.host_numel,), float("nan"))
        for slot in opt.layout.host_slots:
            flat = acc[slot.host_off : slot.host_off + slot.host_numel]
            first = True
            for grads, coef, _ in steps:
                g = grads.get(opt.names[slot.index])
                if g is None:  # no gradient: the first step wrote zeros, later ones nothing
                    if first:
                        flat.zero_()
                        first = False
                    continue
                cols = as_matrix(g, slot)[:, slot.host_c0 : slot.host_c1].t().contiguous()
                _native.accumulate(flat, cols.reshape(-1), scale=coef, overwrite=first)
                first = False
        return acc, grad_scale


@contextmanager
def today(monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module) -> Iterator[Today]:
    """Patch the engine so that its CPU updates read ``Today``'s sums instead of the slots."""
    ref = Today(model)
    coefficient, step, submit = GradientScale.coefficient, ZenFlowOptimizer.step, CpuWorker.submit
    opts: list[ZenFlowOptimizer] = []

    def record_coef(self, *a, **k):
        norm, coef, clip = coefficient(self, *a, **k)
        ref.unscale, ref.clip = self.unscale, clip
        return norm, coef, clip

    def stepped(self, closure=None):
        ref.unscale, ref.clip, ref.current = 1.0, None, dict(ref.latest)
        opts[:] = [self]
        stats = step(self, closure)
        ref.latest.clear()
        if not stats.skipped and not stats.boundary:
            ref.steps.append(ref.this_step())
        return stats

    def submitted(self, update: CpuUpdate, waits=()):
        ref.sums[id(update)] = ref.interval_sum(opts[0])
        ref.submitted += 1
        return submit(self, update, waits)

    def adamw(self, update: CpuUpdate, step_: int, runs: torch.Tensor) -> None:
        h = self._host
        acc, grad_scale = ref.sums[id(update)]
        _native.adamw_step(h.master, acc, h.exp_avg, h.exp_avg_sq, step=step_, lr=update.lr,
                           beta1=update.beta1, beta2=update.beta2, eps=update.eps,
                           weight_decay=update.weight_decay, grad_scale=grad_scale, runs=runs,
                           repeat=update.repeat, out=h.upload)  # bf16/fp16: the install source, as the worker

    with monkeypatch.context() as m:
        m.setattr(GradientScale, "coefficient", record_coef)
        m.setattr(ZenFlowOptimizer, "step", stepped)
        m.setattr(CpuWorker, "submit", submitted)
        m.setattr(CpuWorker, "_adamw", adamw)
        yield ref


def train(cfg, *, hooks: bool, dtype=torch.float32, clip: float | None = 0.5, poison: int | None = None,
          start: dict | None = None, steps: range = range(STEPS), model: torch.nn.Module | None = None,
          save_at: int | None = None) -> tuple[dict, dict | None]:
    """The loop's call pattern over two micro-batches (Gated: the extra head is used at t % 3 == 1
    in the first micro-batch only, at t % 3 == 2 in the final one, never at t % 3 == 0). ``poison``:
    fp16, the step whose loss is inf (skipped). ``save_at``: the state after that many steps
    (a deep copy through torch.save). ``start``: the (model, optimizer) state to resume from."""
    if model is None:
        torch.manual_seed(0)
        model = Gated().to(dtype)
    if start is not None:
        model.load_state_dict(start["model"])
    saved = None
    data = batches(STEPS, dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2, weight_decay=0.01, max_grad_norm=clip) as opt:
        if start is not None:
            opt.load_state_dict(start["opt"])
        for t in steps:
            x, y = data[t]
            opt.zero_grad(set_to_none=True)
            for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
                if hooks:
                    opt.prepare_backward(final=i == 1)
                use = (t % 3 == 1 and i == 0) or (t % 3 == 2 and i == 1)
                loss = torch.nn.functional.mse_loss(model(xm, extra=use).float(), ym.float()) / 2
                if t == poison and i == 1:
                    loss = loss * math.inf
                opt.scale_loss(loss).backward()
            stats = opt.step()
            assert stats.skipped == (t == poison)
            if save_at is not None and t + 1 == save_at:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
                buf.seek(0)
                saved = torch.load(buf, weights_only=True)
        opt.flush()
    return snapshot(model), saved


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


# (hooks, release_grads, host_accumulators, overlap, extra): the host paths and slot set counts.
# ``one-column chunks``: a chunk per column (192 B ring slots), so a column the device owns rides
# along in no chunk, and regather must write a leaving column's gradient into the slot itself.
ONE_COLUMN = {"ring_slot_mb": 200 / 2**20}
PATHS = {
    "step-path-2sets": (False, True, 2, True, {}),
    "hooks-2sets": (True, False, 2, True, {}),
    "release-2sets": (True, True, 2, True, {}),
    "release-1set": (True, True, 1, True, {}),
    "hooks-1set": (True, False, 1, True, {}),
    "release-sequential": (True, True, 1, False, {}),
    "release-one-column-chunks": (True, True, 2, True, ONE_COLUMN),
}


def reference(monkeypatch: pytest.MonkeyPatch, cfg, **kw) -> tuple[dict, Today]:
    """The same run with ``today``'s CPU updates."""
    torch.manual_seed(0)
    model = Gated().to(kw.get("dtype", torch.float32))
    with today(monkeypatch, model) as ref:
        want, _ = train(cfg, model=model, **kw)
    return want, ref


@pytest.mark.parametrize("path", list(PATHS))
def test_slots_are_bit_identical_to_the_per_step_accumulation(monkeypatch, path: str) -> None:
    hooks, release, sets, overlap, extra = PATHS[path]
    cfg = zen(**BASE, release_grads=release, host_accumulators=sets, overlap_step=overlap, **extra)
    got, _ = train(cfg, hooks=hooks)
    want, ref = reference(monkeypatch, cfg, hooks=hooks)
    assert ref.submitted >= 5  # warm-up and interval boundaries; selections at 1, 7, 13
    assert same(got, want)


@pytest.mark.parametrize("path", ["step-path-2sets", "release-2sets", "hooks-1set"])
@pytest.mark.parametrize("poison", [4, 5], ids=["first-of-interval", "mid-interval"])
def test_an_fp16_overflow_step_lands_nothing(monkeypatch, path: str, poison: int) -> None:
    """A skipped step records no slot (the next step rewrites it): the interval's sum is that of
    the steps taken, as the per-step accumulation added nothing for a skipped step; with release,
    what its hooks landed is dropped the same way."""
    hooks, release, sets, overlap, extra = PATHS[path]
    cfg = zen(**BASE, release_grads=release, host_accumulators=sets, overlap_step=overlap, **extra)
    got, _ = train(cfg, hooks=hooks, dtype=torch.float16, poison=poison)
    want, ref = reference(monkeypatch, cfg, hooks=hooks, dtype=torch.float16, poison=poison)
    assert ref.submitted >= 5
    assert same(got, want)


@pytest.mark.parametrize("path", ["step-path-2sets", "release-2sets", "release-1set"])
def test_a_checkpoint_inside_an_interval_resumes_from_its_sum(monkeypatch, path: str) -> None:
    """Saved after two steps of the interval [4, 6] (``acc``: their fp32 sum with the worker's
    rounding), resumed in a new optimizer (the set's carry): the same bits as the run that went
    on, which is today's arithmetic."""
    hooks, release, sets, overlap, extra = PATHS[path]
    cfg = zen(**BASE, release_grads=release, host_accumulators=sets, overlap_step=overlap, **extra)
    straight, saved = train(cfg, hooks=hooks, save_at=6)
    assert saved is not None and saved["opt"]["counters"]["interval_len"] == 2
    resumed, _ = train(cfg, hooks=hooks, start=saved, steps=range(6, STEPS))
    want, _ = reference(monkeypatch, cfg, hooks=hooks)
    assert same(straight, want) and same(resumed, want)
