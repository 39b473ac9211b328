"""The CPU update takes the native threads (offload/threads.py): nothing else runs native code on
the host per step since the gradient slots (slots.py)."""

from __future__ import annotations

import pytest
import torch
from test_offload_helpers import batches, tiny_net, zen

from zfctl import _native as N
from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.cpu.threads import split_threads


def test_the_update_takes_every_thread() -> None:
    assert [split_threads(n) for n in (16, 2, 1, 0)] == [16, 2, 1, 1]


@pytest.mark.parametrize(("announce", "accumulate", "overlap"),
                         [(False, "host", True), (True, "host", True), (True, "host", False), (False, "device", True)],
                         ids=["step-path", "hook-path", "sequential", "device-path"])
def test_only_the_update_calls_native_code_and_it_takes_every_thread(monkeypatch, announce: bool, accumulate: str,
                                                                      overlap: bool) -> None:
    """Every native call of a run is the CPU update's ``adamw_sum``, on pool 0 with all
    ``cpu_threads``: no accumulate runs per step on any path, with or without overlap."""
    seen: dict[str, set] = {"acc": set(), "adam": set()}
    acc, adam = N.accumulate, N.adamw_sum

    def spy_acc(*a, **k):
        seen["acc"].add((N.thread_pool(), N.thread_limit()))
        return acc(*a, **k)

    def spy_adam(*a, **k):
        seen["adam"].add((N.thread_pool(), N.thread_limit()))
        return adam(*a, **k)

    monkeypatch.setattr(N, "accumulate", spy_acc)
    monkeypatch.setattr(N, "adamw_sum", spy_adam)
    before = N.get_num_threads()
    cfg = zen(topk_ratio=0.1, update_interval=2, full_warm_up_rounds=0, cpu_threads=3,
              accumulate=accumulate, overlap_step=overlap)
    model = tiny_net()
    try:
        with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2) as opt:
            assert opt.threads == 3 and opt.accumulate == accumulate
            for x, y in batches(5):
                opt.zero_grad(set_to_none=True)
                if announce:  # else step() lands the gradients (the step() path)
                    opt.prepare_backward(final=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    finally:
        N.set_num_threads(before)
    assert seen["acc"] == set()
    assert seen["adam"] == {(0, 3)}
    assert (N.thread_pool(), N.thread_limit()) == (0, N.get_num_threads())  # the caller is unchanged
