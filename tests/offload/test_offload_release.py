"""zenflow.tuning.release_grads (zfctl/offload/grads/release.py): each gradient leaves the device in its
own hook and its ``.grad`` is freed there.

Release on and off give bit-identical losses in every case: release changes no arithmetic (each
step's host columns land in its own slot, raw, with the step's unscale, and the CPU update
applies the interval's mean clip factor, slots.py, cpu/pipeline.py). No case here only reorders a sum: the hooks take each norm with the kernel
step() uses and the global norm stacks them in parameter order. The clip rule itself is tested
against the pure-torch reference in tests/offload/test_offload_reference.py, the slots against
the per-step accumulation they replaced in tests/offload/test_offload_slots.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_offload_helpers import HID, OUT, TinyNet, batches, snapshot, tiny_net, zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.plan.resolve import resolve_plan
from zfctl.train import run
from zfctl.train.metrics import read_metrics

TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=96", "data.max_length=64", "train.micro_batch_size=2", "train.eval_batches=1",
    "train.device=cpu", "train.precision=fp32", "train.lr=1e-3", "train.eval_every=0",
    "train.max_steps=30", "checkpoint.every=0", "train.warmup_steps=0", "train.schedule=constant",
    "zenflow.cpu_threads=1",
]
NO_CLIP = "train.max_grad_norm=null"
# (zenflow preset, overrides): the default preset runs 20 warm-up steps and selects at steps 21
# and 29 (both released), so 30 steps cover warm-up, selection and overlapped intervals.
CASES = {
    "default-clip": ("default", []),
    "default": ("default", [NO_CLIP]),
    "topk-1-clip": ("default", ["zenflow.topk_ratio=1.0"]),
    "topk-0": ("default", ["zenflow.topk_ratio=0.0", NO_CLIP]),
    "zero-offload-clip": ("zero-offload", []),
    "accumulation-2": ("default", ["train.gradient_accumulation_steps=2", NO_CLIP]),
    "tied": ("default", ["model.config.tie_word_embeddings=true", NO_CLIP]),
}
QUICK = {"default-clip", "zero-offload-clip"}  # the others: -m slow (two 30-step runs each)


def engine(out: Path, preset: str, overrides: list[str], release: bool,
           monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[float | None], list[int]]:
    """The real loop (zfctl.train.run): per step the loss, the gradient norm and how many matrices
    still held a ``.grad`` when step() began (the 1-D params' are not released: release.py)."""
    held: list[int] = []
    step = ZenFlowOptimizer.step

    def counted(self: ZenFlowOptimizer, closure: object = None) -> object:
        held.append(sum(p.grad is not None for p in self.params if p.dim() > 1))
        return step(self, closure)

    plan = resolve_plan("tiny-llama", "alpaca-sample", zenflow=preset, overrides=[
        *TINY, *overrides, f"checkpoint.output_dir={out}", f"zenflow.tuning.release_grads={str(release).lower()}"])
    with monkeypatch.context() as m:
        m.setattr(ZenFlowOptimizer, "step", counted)
        run(plan)
    recs = read_metrics(out / "metrics.jsonl", "train")
    return [r["loss"] for r in recs], [r["grad_norm"] for r in recs], held


@pytest.mark.parametrize("case", [c if c in QUICK else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_release_on_and_off_give_the_same_losses(tmp_path, monkeypatch, case: str) -> None:
    preset, overrides = CASES[case]
    on, norms, held_on = engine(tmp_path / "on", preset, overrides, True, monkeypatch)
    off, _, held_off = engine(tmp_path / "off", preset, overrides, False, monkeypatch)
    assert len(on) == 30 and on == off  # bit-identical, every step
    assert held_on == [0] * 30  # every gradient left in its hook, selection steps included
    assert min(held_off) > 0  # without release step() found them
    if case.endswith("clip"):
        assert all(n > 1.0 for n in norms)  # train.max_grad_norm 1.0 really clips every step


# -- a parameter without a gradient, fp16 overflow (the optimizer with the loop's call pattern) --
class Gated(TinyNet):
    """TinyNet plus a head used only on some micro-batches: its hook fires only when it is."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        out = super().forward(x)
        return out + self.extra(self.fc1(x).tanh()) if extra else out


def gated_run(release: bool, clip: float | None) -> tuple[dict, list[bool]]:
    torch.manual_seed(0)
    model = Gated()
    cfg = zen(topk_ratio=0.25, update_interval=3, select_interval=6, full_warm_up_rounds=1, release_grads=release)
    grads_at_step = []
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2, weight_decay=0.01, max_grad_norm=clip) as opt:
        for t, (x, y) in enumerate(batches(14)):
            opt.zero_grad(set_to_none=True)
            # t % 3: 0 = no gradient at all, 1 = only from the first micro-batch (its hook does
            # not fire in the final backward), 2 = from the final backward
            for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
                opt.prepare_backward(final=i == 1)
                use = (t % 3 == 1 and i == 0) or (t % 3 == 2 and i == 1)
                (torch.nn.functional.mse_loss(model(xm, extra=use), ym) / 2).backward()
            grads_at_step.append(model.extra.weight.grad is not None)
            opt.step()
        opt.flush()
    return snapshot(model), grads_at_step


def test_a_parameter_whose_hook_does_not_fire_is_taken_by_step() -> None:
    on, seen_on = gated_run(True, None)
    off, seen_off = gated_run(False, None)
    assert all(torch.equal(on[n], off[n]) for n in off)
    # release: only the earlier micro-batch's gradient is still there at step(); without: that and
    # the final backward's
    assert seen_on == [t % 3 == 1 for t in range(14)] and seen_off == [t % 3 != 0 for t in range(14)]


def fp16_run(release: bool, poison: str) -> tuple[dict, ZenFlowOptimizer, dict]:
    """Poison one step's loss with inf at an interval's first step (``first``) or inside one
    (``mid``); returns the params, the (closed) optimizer and, for the step after the poisoned
    one, each host matrix's gradient as its hook saw it (a hook registered before the optimizer's)."""
    model = tiny_net(dtype=torch.float16)
    seen: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda q, n=n: seen.__setitem__(n, q.grad.clone()))
    cfg = zen(topk_ratio=0.1, update_interval=3, select_interval=6, full_warm_up_rounds=1, release_grads=release)
    after: dict = {}
    poisoned = None
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-3) as opt:
        for x, y in batches(12, dtype=torch.float16):
            opt.zero_grad(set_to_none=True)
            opt.prepare_backward(final=True)
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            hit = poisoned is None and opt.pipeline.t >= 4 and opt.pipeline.first_of_interval == (poison == "first")
            opt.scale_loss(loss * math.inf if hit else loss).backward()
            scale = opt.scaler.scale
            stats = opt.step()
            assert stats.skipped == hit
            if hit:
                poisoned = opt.pipeline.t
            elif poisoned is not None and not after:  # the step after the overflow
                grads, cur = opt.host.grads, opt.pipeline.cur
                j = grads.used(cur) - 1
                after = {"seen": dict(seen), "slot": grads.slot(cur, j).clone(), "scale": scale,
                         "coef": grads.coefs[cur][j], "used": grads.used(cur),
                         "interval_len": opt.pipeline.interval_len, "owned": opt.host.device_owned.clone()}
        opt.flush()
        layout = opt.layout
    after["layout"] = layout
    return snapshot(model), opt, after


@pytest.mark.parametrize("poison", ["first", "mid"])
def test_fp16_overflow_is_bit_identical_with_and_without_release(poison: str) -> None:
    on, _, _ = fp16_run(True, poison)
    off, _, _ = fp16_run(False, poison)
    assert all(torch.equal(on[n], off[n]) for n in off)


def test_fp16_overflow_inside_an_interval_keeps_the_steps_before_it() -> None:
    """What the overflow step's hooks landed is not recorded: after the next step the interval
    holds the steps before the overflow and that step, whose slot is exactly its raw gradient,
    with 1 / the loss scale (its unscale) as its coefficient."""
    _, _, after = fp16_run(True, "mid")
    assert after["interval_len"] >= 2 and after["used"] == after["interval_len"]
    names = dict(zip(range(len(after["layout"].slots)), (s.name for s in after["layout"].slots)))
    checked = 0
    for slot in after["layout"].host_slots:
        g = after["seen"][names[slot.index]]  # [out, in] = [rows, cols] of a Linear weight
        host = ~after["owned"][slot.host_col0 : slot.host_col0 + slot.host_c1 - slot.host_c0]
        got = slot.host_view(after["slot"])[host]
        assert torch.equal(got, g.t()[host])
        checked += int(host.sum())
    assert checked > 0 and after["coef"] == 1.0 / after["scale"]


def piecewise_run(tiny: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, int]:
    """14 released steps (selections at 1, 7, 13) with the migration's pieces one row each
    (``tiny``: every seam of the packing, and in-ring slots reused within a selection), or as
    large as they come. fp16: the step's slot holds the loss-scaled raw gradient, which the moves
    carry as it is. Returns the parameters and how many gradient tensors moved."""
    from zfctl.offload import optimizer as engine
    from zfctl.offload import sizing

    moved = [0]
    pairs_of = engine.regather_pairs

    def counted(*a, **k):
        pairs = pairs_of(*a, **k)

        def wrapped(m, to):
            out = pairs(m, to)
            moved[0] += out is not None
            return out
        return wrapped

    with monkeypatch.context() as m:
        m.setattr(engine, "regather_pairs", counted)
        if tiny:
            m.setattr(sizing, "STAGE_BYTES", 4)  # each piece and ring slot: one row of the tallest matrix
        model = tiny_net(dtype=dtype)
        cfg = zen(topk_ratio=0.25, update_interval=3, select_interval=6, full_warm_up_rounds=1, release_grads=True)
        with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2, weight_decay=0.01) as opt:
            for x, y in batches(14, dtype=dtype):
                opt.zero_grad(set_to_none=True)
                opt.prepare_backward(final=True)
                opt.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y.float())).backward()
                opt.step()
            opt.flush()
    return snapshot(model), moved[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_released_selection_moves_the_gradient_in_pieces_with_the_same_bits(monkeypatch, dtype) -> None:
    """On a released selection step the work buffer's leaving and entering gradient columns move
    with the state (release.py ``regather_pairs``, migration.py), to and from the step's slot in
    the model dtype: cut into one-row pieces they give the same parameters, bit for bit, as in whole pieces."""
    tiny, moved = piecewise_run(True, dtype, monkeypatch)
    whole, _ = piecewise_run(False, dtype, monkeypatch)
    assert moved > 0
    assert all(torch.equal(tiny[n], whole[n]) for n in whole)
