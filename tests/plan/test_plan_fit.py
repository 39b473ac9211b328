"""The activations line under train.activation_checkpointing, its `auto`, and what `--fit` changes
(zfctl/plan/fit.py): cheapest first, cumulative, the global batch kept, never below topk 0.05."""

from __future__ import annotations

import pytest

from zfctl.errors import UserError
from zfctl.plan.fit import (
    MIN_LENGTH,
    MIN_TOPK,
    fit,
    fit_or_fail,
    resolve_activation_checkpointing,
    shortfall,
    with_sets,
)
from zfctl.plan.memory import GB, Machine, estimate
from zfctl.plan.resolve import resolve_plan


def _plan(model: str, *sets: str, data: str = "alpaca"):
    return resolve_plan(model, data, overrides=list(sets))


def test_activations_line_with_and_without_recompute() -> None:
    """Without: 34 h w/2 bytes per token per layer; with: h w per token per layer (the layer
    inputs) + one layer's 34 h w/2 (the recompute); the logits either way."""
    off = _plan("llama2-7b", "train.activation_checkpointing=false", "train.micro_batch_size=2")
    on = with_sets(off, {"train.activation_checkpointing": True})
    m = Machine(1024 * GB, True, "big", 1024 * GB)
    h, layers, vocab, w, tokens = 4096, 32, 32000, 2, 2 * off.data.max_length
    logits = tokens * vocab * (w + 8)
    e_off, e_on = estimate(off, m), estimate(on, m)
    assert e_off.item("activations (rough)") == layers * tokens * h * 34 * w / 2 + logits
    assert e_on.item("activations (rough)") == layers * tokens * h * w + tokens * h * 34 * w / 2 + logits
    assert next(i for i in e_on.items if i.name == "activations (rough)").note.endswith("recompute per layer")
    assert next(i for i in e_off.items if i.name == "activations (rough)").note.endswith("no recompute")
    assert e_off.device_total - e_on.device_total == pytest.approx(layers * tokens * h * w * 16 - tokens * h * 17 * w)


def test_auto_is_on_only_when_it_makes_the_plan_fit_better() -> None:
    # 24 GB: the device is short, so the recompute helps.
    short_device = _plan("llama2-7b", "machine.gpu_memory=24GB", "machine.host_memory=128GB")
    assert short_device.train.activation_checkpointing is True
    # 80 GB + 128 GB fits as it is: off.
    assert _plan("llama2-7b", "machine.gpu_memory=80GB", "machine.host_memory=128GB").train.activation_checkpointing is False
    # Only the host is short (a GPU run): the activations live on the device, so off.
    plan = _plan("llama2-7b", "machine.gpu_memory=200GB", "machine.host_memory=64GB", "zenflow.accumulate=host")
    assert not estimate(plan).fits and plan.train.activation_checkpointing is False
    # The plan keeps the concrete value; a library plan's auto resolves the same way.
    lib = with_sets(short_device, {"train.activation_checkpointing": "auto"})
    notes: list[str] = []
    assert resolve_activation_checkpointing(lib, notes=notes) is True and lib.train.activation_checkpointing is True
    assert notes and "auto" in notes[0] and "GB ->" in notes[0]


def test_checkpointing_is_the_first_change_when_activations_are_the_problem() -> None:
    # llama3.2-1b at 4 x 4096 tokens: ~40 GB of activations on a 40 GB GPU.
    plan = _plan("llama3.2-1b", "data.max_length=4096", "train.micro_batch_size=4",
                 "train.activation_checkpointing=false", "machine.gpu_memory=40GB", "machine.host_memory=256GB")
    before = estimate(plan)
    assert not before.fits
    result = fit(plan)
    assert result.fits and result.estimate.fits
    assert result.changes[0].sets == {"train.activation_checkpointing": True}
    assert result.changes[0].flags == "--set train.activation_checkpointing=true"
    assert result.plan.train.activation_checkpointing is True
    assert result.plan.zenflow.topk_ratio == plan.zenflow.topk_ratio  # nothing dearer than needed
    assert result.plan.data.max_length == 4096
    assert shortfall(result.estimate) == 0 < shortfall(before)
    assert result.to_dict()["flags"].startswith("--set train.activation_checkpointing=true")


def test_a_smaller_micro_batch_keeps_the_global_batch() -> None:
    # Checkpointing already on: what is left of the activations (the logits, the layer inputs)
    # scales with the micro-batch.
    plan = _plan("llama3.2-1b", "data.max_length=4096", "train.micro_batch_size=8",
                 "train.gradient_accumulation_steps=3", "train.activation_checkpointing=true",
                 "zenflow.accumulate=host", "machine.gpu_memory=40GB", "machine.host_memory=256GB")
    assert not estimate(plan).fits
    result = fit(plan)
    assert result.fits
    keys = [k for c in result.changes for k in c.sets]
    assert "train.micro_batch_size" in keys and "zenflow.topk_ratio" not in keys and "data.max_length" not in keys
    t = result.plan.train
    assert t.micro_batch_size < 8 and t.micro_batch_size * t.gradient_accumulation_steps == 8 * 3
    # The largest micro-batch that fits: the next larger divisor of 8 does not.
    bigger = with_sets(plan, {"train.micro_batch_size": t.micro_batch_size * 2,
                              "train.gradient_accumulation_steps": 24 // (t.micro_batch_size * 2)})
    assert not estimate(with_sets(bigger, {k: v for c in result.changes for k, v in c.sets.items()
                                           if not k.startswith("train.")})).fits


@pytest.mark.parametrize("gpu", ["16GB", "20GB", "24GB", "32GB"])
def test_fit_never_goes_below_topk_005(gpu: str) -> None:
    plan = _plan("llama2-7b", f"machine.gpu_memory={gpu}", "machine.host_memory=512GB")
    result = fit(plan)
    assert float(result.plan.zenflow.topk_ratio) >= MIN_TOPK
    assert result.plan.data.max_length >= MIN_LENGTH
    if not result.fits:
        assert any("not lowered below 0.05" in n for n in result.notes)
    # Cheapest first: a later change never comes before an earlier kind in the list.
    order = ["train.activation_checkpointing", "zenflow.accumulate", "train.micro_batch_size",
             "zenflow.topk_ratio", "data.max_length"]
    firsts = [order.index(next(iter(c.sets))) for c in result.changes]
    assert firsts == sorted(firsts)
    assert bool(result.changes) == (not estimate(plan).fits)  # changes only where the plan needs them


def test_a_plan_that_fits_changes_nothing() -> None:
    plan = _plan("llama2-7b", "machine.gpu_memory=80GB", "machine.host_memory=128GB")
    result = fit(plan)
    assert result.fits and result.changes == [] and result.plan is plan


def test_nothing_fits_is_one_user_error_naming_what_was_tried() -> None:
    plan = _plan("llama2-13b", "machine.gpu_memory=8GB", "machine.host_memory=16GB")
    with pytest.raises(UserError) as e:
        fit_or_fail(plan)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--fit: nothing makes this plan fit")
    assert "--gpu-memory" in msg and "zenflow.topk_ratio=0.05" in msg


def test_the_cheapest_change_wins_when_several_would_fit() -> None:
    """The device 0.2 GB short: lowering topk_ratio to 0.075 would fit, and so would recompute;
    recompute costs no accuracy, so it is the one taken, alone."""
    plan = _plan("llama3.2-1b", "train.activation_checkpointing=false", "zenflow.accumulate=host",
                 "machine.host_memory=256GB")
    need = estimate(plan, Machine(256 * GB, True, "x", 1024 * GB)).device_total
    gpu = (need - 0.2 * GB) / 0.95  # zfctl/plan/memory.py DEVICE_MARGIN: 5% kept free
    plan = with_sets(plan, {"machine.gpu_memory": f"{gpu:.0f}B"})
    assert not estimate(plan).fits
    assert estimate(with_sets(plan, {"zenflow.topk_ratio": 0.075})).fits  # the dearer way out also fits
    result = fit(plan)
    assert [c.sets for c in result.changes] == [{"train.activation_checkpointing": True}]


def test_a_change_made_redundant_by_a_later_one_is_dropped() -> None:
    """Short by 0.3 GB with short sequences: recompute (taken first, the cheapest) saves too little,
    topk_ratio 0.075 then fits, and it fits without the recompute too: only topk is kept."""
    plan = _plan("llama3.2-1b", "train.activation_checkpointing=false", "zenflow.accumulate=host",
                 "data.max_length=128", "train.micro_batch_size=1", "machine.host_memory=256GB")
    need = estimate(plan, Machine(256 * GB, True, "x", 1024 * GB)).device_total
    plan = with_sets(plan, {"machine.gpu_memory": f"{(need - 0.3 * GB) / 0.95:.0f}B"})
    saved = estimate(plan).device_total - estimate(with_sets(plan, {"train.activation_checkpointing": True})).device_total
    assert 0 < saved < 0.3 * GB  # the recompute alone is not enough
    result = fit(plan)
    assert result.fits and [c.sets for c in result.changes] == [{"zenflow.topk_ratio": 0.075}]
    assert result.plan.train.activation_checkpointing is False


def test_with_sets_validates_and_reaches_nested_keys() -> None:
    from zfctl.errors import ConfigError

    plan = _plan("tiny-llama", data="alpaca-sample")
    before = (plan.zenflow.tuning.ring_slots, plan.train.micro_batch_size)
    assert before != (8, 2)
    changed = with_sets(plan, {"zenflow.tuning.ring_slots": 8, "train.micro_batch_size": 2})
    assert changed.zenflow.tuning.ring_slots == 8 and changed.train.micro_batch_size == 2
    assert (plan.zenflow.tuning.ring_slots, plan.train.micro_batch_size) == before  # a copy: the plan is untouched
    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        with_sets(plan, {"train.micro_batch_size": 0})
