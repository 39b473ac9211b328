"""zenflow.accumulate_threads: the accumulation and the CPU update share the cores (offload/threads.py)."""

from __future__ import annotations

import pytest
import torch
from test_offload_helpers import batches, tiny_net, zen

from zfctl import _native as N
from zfctl.errors import ConfigError
from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer
from zfctl.offload.config import TuningConfig
from zfctl.offload.threads import ACC_POOL, split_threads


def test_default_split_follows_bytes_per_element() -> None:
    assert split_threads(16) == (4, 12)  # 16 * 10/38 = 4.2
    assert split_threads(8) == (2, 6)
    assert split_threads(2) == (1, 1)
    assert split_threads(1) == (1, 1)  # one core: both take it, nothing is left idle
    assert split_threads(64) == (17, 47)


def test_explicit_split_overrides_and_clamps() -> None:
    assert split_threads(16, 2) == (2, 14)
    assert split_threads(4, 9) == (4, 1)  # more than there are: all of them, the update keeps one


def test_accumulate_threads_is_validated() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="zenflow.tuning.accumulate_threads"):
            ZenFlowConfig(tuning=TuningConfig(accumulate_threads=bad)).validate()


@pytest.mark.parametrize("stream", [False, True])
def test_option_reaches_the_native_calls(monkeypatch, stream: bool) -> None:
    """Every accumulate runs on the accumulation pool capped at accumulate_threads; every AdamW of
    the background update on pool 0 capped at the rest."""
    seen: dict[str, set] = {"acc": set(), "adam": set()}
    acc, adam = N.accumulate, N.adamw_step

    def spy_acc(*a, **k):
        seen["acc"].add((N.thread_pool(), N.thread_limit()))
        return acc(*a, **k)

    def spy_adam(*a, **k):
        seen["adam"].add((N.thread_pool(), N.thread_limit()))
        return adam(*a, **k)

    monkeypatch.setattr(N, "accumulate", spy_acc)
    monkeypatch.setattr(N, "adamw_step", spy_adam)
    before = N.get_num_threads()
    cfg = zen(topk_ratio=0.1, update_interval=2, full_warm_up_rounds=0, cpu_threads=3,
              accumulate_threads=1, stream_grads=stream)
    model = tiny_net()
    try:
        with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2) as opt:
            assert opt.threads == (1, 2)
            for x, y in batches(5):
                opt.zero_grad(set_to_none=True)
                if stream:
                    opt.prepare_backward(final=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    finally:
        N.set_num_threads(before)
    assert seen["acc"] == {(ACC_POOL, 1)}
    assert seen["adam"] == {(0, 2)}
    assert (N.thread_pool(), N.thread_limit()) == (0, N.get_num_threads())  # the caller is restored


def test_without_overlap_the_update_takes_every_thread(monkeypatch) -> None:
    seen: set = set()
    adam = N.adamw_step

    def spy_adam(*a, **k):
        seen.add(N.thread_limit())
        return adam(*a, **k)

    monkeypatch.setattr(N, "adamw_step", spy_adam)
    before = N.get_num_threads()
    cfg = zen(topk_ratio=0.1, update_interval=2, full_warm_up_rounds=0, cpu_threads=3,
              overlap_step=False)
    model = tiny_net()
    try:
        with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2) as opt:
            for x, y in batches(3):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    finally:
        N.set_num_threads(before)
    assert seen == {3}


def test_device_path_update_takes_every_thread(monkeypatch) -> None:
    """accumulate: device adds nothing on the host between boundaries: the background update's
    AdamW runs on all cpu_threads, not on what the (idle) accumulation's share leaves."""
    seen: set = set()
    adam = N.adamw_step

    def spy_adam(*a, **k):
        seen.add((N.thread_pool(), N.thread_limit()))
        return adam(*a, **k)

    monkeypatch.setattr(N, "adamw_step", spy_adam)
    before = N.get_num_threads()
    cfg = zen(topk_ratio=0.1, update_interval=2, full_warm_up_rounds=0, cpu_threads=3, accumulate="device")
    model = tiny_net()
    try:
        with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2) as opt:
            assert opt.accumulate == "device" and opt.threads == (0, 3)
            for x, y in batches(5):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    finally:
        N.set_num_threads(before)
    assert seen == {(0, 3)}
