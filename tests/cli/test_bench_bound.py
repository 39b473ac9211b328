"""The bound `zfctl bench` prints (zfctl/bench/bound.py): its arithmetic on made-up numbers, the
machine probe, and the columns and JSON fields of a real (tiny) run."""

from __future__ import annotations

import pytest

from zfctl.bench.bound import (
    Machine,
    add_bounds,
    bound,
    bytes_per_step,
    gap_parts,
    llc_bytes,
    measure_host_gbps,
)
from zfctl.bench.grid import BenchConfig
from zfctl.bench.runner import ConfigResult, StepRecord, TrialResult
from zfctl.bench.summary import summarize

GPU = Machine(d2h_gbps=50.0, h2d_gbps=40.0, host_gbps=100.0, host_threads=16, same_cores=False)
CPU = Machine(d2h_gbps=None, h2d_gbps=None, host_gbps=10.0, host_threads=2, same_cores=True)


def rec(ms: float, *, update: bool = False, selection: bool = False, nbytes: dict | None = None,
        wait_ms: dict | None = None) -> StepRecord:
    return StepRecord(update=update, step_ms=ms, fwd_ms=ms / 4, bwd_ms=ms / 2, opt_ms=ms / 4, device_opt_ms=1.0,
                      offload_ms=0.0, cpu_step_ms=0.0, stall_ms=0.0, d2h_bytes=0, h2d_bytes=0, skipped=False,
                      selection=selection, bytes=nbytes or {}, wait_ms=wait_ms or {})


def test_bytes_per_step_are_the_ledger_means_with_a_total_each_way() -> None:
    recs = [rec(10, nbytes={"d2h.grad": 100, "host.land": 100, "host.sum": 300}),
            rec(10, update=True, nbytes={"d2h.grad": 100, "h2d.install": 400, "host.land": 100, "host.update": 900})]
    per = bytes_per_step(recs)
    assert per == {"d2h.grad": 100, "h2d.install": 200, "host.land": 100, "host.sum": 150, "host.update": 450,
                   "d2h": 100, "h2d": 200, "host": 700}


def test_the_bound_is_the_slowest_resource_on_a_gpu() -> None:
    # 1 GB D2H at 50 GB/s = 20 ms; 0.5 GB H2D at 40 GB/s = 12.5 ms; 3 GB host at 100 GB/s = 30 ms
    per = {"d2h": 1e9, "h2d": 0.5e9, "host": 3e9}
    b = bound(per, 25.0, GPU)
    assert b["terms_ms"] == {"device": 25.0, "d2h": pytest.approx(20.0), "h2d": pytest.approx(12.5),
                             "host": pytest.approx(30.0)}
    assert (b["bound_ms"], b["limit"], b["unmeasured"]) == (pytest.approx(30.0), "host", [])
    assert bound(per, 45.0, GPU)["limit"] == "device"
    assert bound({"d2h": 3e9}, 25.0, GPU)["bound_ms"] == pytest.approx(60.0)  # the link, 3 GB at 50 GB/s


def test_on_cpu_compute_and_host_memory_share_the_cores_and_no_link_exists() -> None:
    b = bound({"d2h": 1e9, "h2d": 1e9, "host": 2e8}, 25.0, CPU)  # 0.2 GB at 10 GB/s = 20 ms
    assert b["limit"] == "device + host" and b["bound_ms"] == pytest.approx(45.0)
    assert b["terms_ms"]["d2h"] is None and b["terms_ms"]["h2d"] is None and b["unmeasured"] == ["d2h", "h2d"]


def test_a_resource_without_a_rate_is_left_out_and_named() -> None:
    m = Machine(d2h_gbps=None, h2d_gbps=40.0, host_gbps=None, host_threads=1, same_cores=False)
    b = bound({"d2h": 1e9, "h2d": 4e8, "host": 1e9}, 5.0, m)
    assert (b["bound_ms"], b["limit"]) == (pytest.approx(10.0), "h2d") and b["unmeasured"] == ["d2h", "host"]
    assert bound({}, None, m) == {"terms_ms": {"device": None, "d2h": 0.0, "h2d": 0.0, "host": 0.0},
                                  "bound_ms": 0.0, "limit": "d2h", "unmeasured": ["device"]}


def test_the_gap_is_split_into_selection_install_waits_and_the_rest() -> None:
    recs = [rec(10), rec(12), rec(10),  # ordinary steps: median 10
            rec(20, update=True, wait_ms={"host.cpu_update": 4.0, "device.install": 2.0}),
            rec(50, selection=True, wait_ms={"host.cpu_update": 30.0}),  # a selection: 40 above the median
            rec(10, wait_ms={"host.slot_gate": 1.0, "host.hook_budget": 1.0})]
    gap = gap_parts(recs, measured_ms=112 / 6, bound_ms=8.0)
    n = len(recs)
    assert gap["selection"] == pytest.approx(40 / n)  # its waits are in it, not counted again
    assert gap["install"] == pytest.approx(2 / n) and gap["boundary wait"] == pytest.approx(4 / n)
    assert gap["hook wait"] == pytest.approx(2 / n) and gap["copy wait"] == 0
    assert gap["other"] == pytest.approx(112 / 6 - 8 - 48 / n)
    assert gap_parts([rec(10, update=True)], 10.0, 8.0)["selection"] == 0  # no selection: nothing to it
    assert gap_parts([rec(50, selection=True)], 50.0, None)["selection"] is None  # no step to compare with
    assert "other" not in gap_parts([rec(10)], 10.0, None)  # no bound: no rest


def test_each_row_gets_its_bound_with_device_compute_from_the_off_row() -> None:
    def result(name: str, recs: list[StepRecord]) -> tuple[dict, ConfigResult]:
        res = ConfigResult(BenchConfig(name, 0.1, 4, True, True), warmup_steps=0, steps=len(recs))
        res.trials.append(TrialResult(recs, window_wall_ms=100.0, loss_first=1.0, loss_last=1.0))
        return summarize(res, param_bytes=1, samples_per_step=1, tokens_per_step=1), res

    off_row, off = result("off", [rec(8.0)] * 2)  # forward 2 + backward 4 = 6 ms
    zf_row, zf = result("zenflow", [rec(40.0, nbytes={"d2h.grad": int(5e8), "host.sum": int(2e9)})] * 2)
    add_bounds([off_row, zf_row], [off, zf], GPU)
    b = zf_row["bound"]
    assert b["terms_ms"]["device"] == pytest.approx(6.0 + 1.0)  # off's passes + its own device optimizer
    assert (b["limit"], b["bound_ms"], b["device_source"]) == ("host", pytest.approx(20.0), "off")
    assert b["ratio"] == pytest.approx(40.0 / 20.0) and b["bytes_per_step"]["host"] == 2e9
    assert off_row["bound"]["ratio"] == pytest.approx(8.0 / 7.0) and off_row["bound"]["limit"] == "device"


def test_llc_is_the_largest_cache_in_sysfs(tmp_path) -> None:
    for i, size in enumerate(("32K", "1024K", "36M")):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert llc_bytes(tmp_path) == 36 * 2**20
    assert llc_bytes(tmp_path / "none") == 32 * 2**20  # sysfs silent: the default


def test_the_host_probe_streams_the_native_adamw() -> None:
    gbps = measure_host_gbps(1, elems=1 << 18)
    assert gbps is not None and gbps > 0
