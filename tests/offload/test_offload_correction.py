"""zenflow.deferred_lr_scale changes the CPU step's lr (and weight decay, to keep U steps' worth)
or, with 'repeat', the number of CPU steps (and the host step counters), and nothing else; 'off'
leaves the engine bit-identical to the uncorrected update.

The full algorithm with a correction is checked against the literal statement in
test_offload_reference.py; here: the factor itself, what each CPU update receives, and that 'off'
is exactly the old arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_offload_helpers import snapshot, tiny_net, train, zen

from zfctl.errors import ConfigError
from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer
from zfctl.offload.cpu import worker as worker_module
from zfctl.offload.cpu.correction import corrected_hyperparams, inner_steps, lr_scale
from zfctl.offload.cpu.worker import CpuWorker

_SUBMIT = CpuWorker.submit  # the real one, before any test wraps it
HP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def test_factor_per_mode() -> None:
    assert [lr_scale(m, 4) for m in ("off", "sqrt", "linear", "repeat")] == [1.0, 2.0, 4.0, 1.0]
    assert all(lr_scale(m, 1) == 1.0 for m in ("off", "sqrt", "linear"))  # warm-up / U=1: never scaled
    assert [inner_steps(m, 4) for m in ("off", "sqrt", "linear", "repeat")] == [1, 1, 1, 4]
    assert inner_steps("repeat", 1) == 1
    lr, wd = 3e-4, 0.1
    for n in (1, 2, 3, 7, 16):
        for mode in ("off", "repeat"):
            got_lr, got_wd = corrected_hyperparams(mode, n, lr, wd)
            assert got_lr is lr and got_wd is wd  # the very same floats: no arithmetic at all
        for mode in ("sqrt", "linear"):
            got_lr, got_wd = corrected_hyperparams(mode, n, lr, wd)
            assert got_lr == pytest.approx(lr * lr_scale(mode, n))
            assert got_lr * got_wd == pytest.approx(n * lr * wd)  # n steps of decoupled decay


def _updates(cfg: ZenFlowConfig, monkeypatch: pytest.MonkeyPatch, steps: int = 24):
    """(lr, weight_decay, grad_scale) of every CPU update submitted while training ``steps`` steps
    (with ``repeat`` as a fourth item where it is not 1)."""
    seen = []

    def spy(self, update, *args, **kwargs):
        seen.append((update.lr, update.weight_decay, update.grad_scale, *([update.repeat] * (update.repeat != 1))))
        return _SUBMIT(self, update, *args, **kwargs)

    monkeypatch.setattr(CpuWorker, "submit", spy)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        train(model, opt, steps, scheduler=sched)
        opt.flush()
    return seen, snapshot(model)


@pytest.mark.parametrize("mode", ["off", "sqrt", "linear"])
def test_each_cpu_update_gets_the_scaled_lr(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Warm-up (1-step intervals), a re-selection (drain: a shortened interval) and full intervals.
    cfg = zen(topk_ratio=0.25, update_interval=4, full_warm_up_rounds=2, select_interval=8,
              deferred_lr_scale=mode)
    seen, _ = _updates(cfg, monkeypatch)
    lengths = [round(1 / gs) for _, _, gs in seen]
    assert 1 in lengths and 4 in lengths
    for (lr, wd, _), n in zip(seen, lengths):  # one step each: no fourth item
        s = lr_scale(mode, n)
        # The scheduled lr of that boundary step is lr/s; wd is U steps' worth (or untouched).
        base_lr = lr / s
        assert any(math.isclose(base_lr, HP["lr"] / (1 + 0.1 * t), rel_tol=1e-12) for t in range(24))
        assert wd == (HP["weight_decay"] if s == 1.0 else pytest.approx(HP["weight_decay"] * n / s))


def test_repeat_takes_n_steps_at_the_scheduled_lr(monkeypatch: pytest.MonkeyPatch) -> None:
    """repeat: lr and wd reach the CPU untouched, the update takes as many steps as its interval
    had (1 in warm-up, 4, or fewer before a re-selection), and the host counters count them."""
    cfg = zen(topk_ratio=0.25, update_interval=4, full_warm_up_rounds=2, select_interval=8,
              deferred_lr_scale="repeat")
    seen, _ = _updates(cfg, monkeypatch)
    plain, _ = _updates(replace(cfg, deferred_lr_scale="off"), monkeypatch)
    assert [u[:3] for u in seen] == plain  # the same lr, wd and mean-gradient scale as 'off'
    reps = [u[3] if len(u) == 4 else 1 for u in seen]
    assert reps == [round(1 / gs) for _, _, gs, *_ in seen] and 4 in reps and 1 in reps
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        train(model, opt, 12)  # warm-up 2 (1 each), then 4 + 4 and 2 of an open interval
        opt.flush()
        host = ~opt.host.device_owned
        assert torch.all(opt.host.steps[host] <= 10) and opt.host.steps[host].max() == 10


def test_off_is_bit_identical_to_the_uncorrected_update(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = zen(topk_ratio=0.25, update_interval=4, select_interval=8)
    assert cfg.deferred_lr_scale == "off"  # the paper's (test_offload_helpers.PAPER)
    seen_off, off = _updates(cfg, monkeypatch)
    _, scaled = _updates(replace(cfg, deferred_lr_scale="sqrt"), monkeypatch)
    assert not all(torch.equal(scaled[n], off[n]) for n in off)  # the comparison can see a change
    # The engine as it was before the option: the boundary's lr and wd go to the CPU unchanged.
    monkeypatch.setattr(worker_module, "corrected_hyperparams", lambda mode, n, lr, wd: (lr, wd))
    seen_old, old = _updates(cfg, monkeypatch)
    assert seen_off == seen_old
    assert all(torch.equal(off[n], old[n]) for n in old)


def test_device_columns_and_dense_params_ignore_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    # topk 1: no CPU columns at all, so the option can have no effect; U=1 (zero-offload): n is 1.
    for base in (zen(topk_ratio=1.0), zen(topk_ratio=0.0, update_interval=1, overlap_step=False)):
        _, a = _updates(base, monkeypatch, steps=8)
        for mode in ("linear", "repeat"):
            _, b = _updates(replace(base, deferred_lr_scale=mode), monkeypatch, steps=8)
            assert all(torch.equal(a[n], b[n]) for n in a)


def test_bad_value_names_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        ZenFlowConfig(deferred_lr_scale="double").validate()
    assert "zenflow.deferred_lr_scale" in str(e.value) and "off, sqrt, linear, repeat" in str(e.value)
