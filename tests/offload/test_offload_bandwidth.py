"""The hook path's in-flight gradient bytes are sized from a D2H rate (offload/bandwidth.py)."""

from __future__ import annotations

import pytest
from test_offload_helpers import tiny_net, zen

from zfctl.errors import ConfigError
from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer
from zfctl.offload.config import TuningConfig
from zfctl.offload.sizing import MAX_BYTES, MIN_BYTES, inflight_bytes

MiB = 2**20


def test_inflight_bytes_cover_the_window() -> None:
    # 50 GB/s for 2 ms is 100 MB; 10 GB/s for 2 ms is 20 MB.
    assert inflight_bytes(50.0) == 100_000_000
    assert inflight_bytes(10.0) == 20_000_000
    assert inflight_bytes(50.0, window_ms=4.0) == 200_000_000


def test_inflight_bytes_clamp() -> None:
    assert inflight_bytes(1.0) == MIN_BYTES  # 2 MB: raised to the floor
    assert inflight_bytes(5000.0) == MAX_BYTES  # 10 GB: capped
    assert inflight_bytes(50.0, lo=MiB, hi=8 * MiB) == 8 * MiB
    for rate in (0.0, -3.0, float("nan"), float("inf")):  # nothing measured usefully: the floor
        assert inflight_bytes(rate) == MIN_BYTES
    with pytest.raises(ValueError, match="lo"):
        inflight_bytes(50.0, lo=2, hi=1)


def test_inflight_budget_follows_the_setting_and_defaults_on_cpu() -> None:
    base = {"topk_ratio": 0.1, "update_interval": 2}
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), zen(**base), lr=1e-2) as opt:
        grad_bytes = opt.layout.host_numel * opt.transfers.itemsize
        ring = opt.config.tuning.ring_slots * opt.transfers.d2h.slot_bytes
        assert opt.gradient_path.d2h_gbps is None  # no probe off CUDA
        assert opt.gradient_path.stream.budget_bytes == min(4 * ring, grad_bytes)
    with ZenFlowOptimizer(model.named_parameters(), zen(**base, inflight_mb=1e-4), lr=1e-2) as opt:
        assert opt.gradient_path.stream.budget_bytes == min(int(1e-4 * MiB), grad_bytes)


def test_inflight_mb_is_validated() -> None:
    with pytest.raises(ConfigError, match="zenflow.tuning.inflight_mb"):
        ZenFlowConfig(tuning=TuningConfig(inflight_mb=-1)).validate()
