"""`zenflow.accumulate: auto` is resolved by the plan's memory estimate, which `zfctl plan` shows."""

from __future__ import annotations

import pytest

from zfctl.errors import ConfigError
from zfctl.plan import resolve_plan
from zfctl.plan.memory import GB, Machine, estimate

P2 = 6.738e9 - (2 * 32 + 1) * 4096  # llama2-7b's 2-D weights


def test_auto_keeps_the_sum_on_the_host_while_a_host_layout_fits() -> None:
    """``accumulate: auto`` takes the device path last (zfctl/plan/layouts.py: slots > carry >
    device): only where the host cannot hold the carry and the device holds the sum."""
    plan = resolve_plan("llama2-7b", "alpaca")
    assert plan.zenflow.accumulate == "auto"
    big = estimate(plan, Machine(512 * GB, True, "B200", 180 * GB))
    assert big.accumulate == "host" and big.item("gradient accumulator") == 0
    assert any("zenflow.accumulate (auto): host" in n for n in big.notes)
    small = estimate(plan, Machine(512 * GB, True, "L4", 24 * GB))
    assert small.accumulate == "host" and small.item("gradient accumulator") == 0
    # the host path: 4 bf16 gradient slots per set (update_interval 4), two sets (512 GB hold them);
    # release_grads (the default): one matrix's .grad at a time, the largest (the 32000 x 4096
    # embedding, bf16), and the 1-D params' (65 norm weights of 4096)
    assert small.item("gradient slots") == pytest.approx(2 * 4 * 2 * P2) and small.host_accumulators == 2
    assert small.item("gradients") == 2 * (32000 * 4096 + 65 * 4096)
    cpu = estimate(plan, Machine(512 * GB, False))
    assert cpu.accumulate == "host"
    off = estimate(resolve_plan("llama2-7b", "alpaca", overrides=["zenflow.tuning.release_grads=false"]),
                   Machine(512 * GB, True, "L4", 24 * GB))
    assert off.item("gradient slots") == small.item("gradient slots")  # release moves no host memory
    assert off.item("gradients") == pytest.approx(2 * 6.738e9, rel=1e-3)  # every .grad until step()
    # A host that holds the device path's fp32 sum but not the carry's landing ring besides it:
    # the device takes the sum where it fits (device_fits), and its host side is that sum.
    fixed = ["zenflow.tuning.staging_mb=64", "zenflow.tuning.upload_buffer=false"]
    dev = estimate(resolve_plan("llama2-7b", "alpaca", overrides=[*fixed, "zenflow.accumulate=device"]),
                   Machine(512 * GB, True, "B200", 180 * GB))
    tight = Machine(dev.host_total + 15 * GB + 1e6, True, "B200", 180 * GB)
    last = estimate(resolve_plan("llama2-7b", "alpaca", overrides=fixed), tight)
    assert last.accumulate == "device" and last.fits and last.item("gradient accumulator") == pytest.approx(4 * P2)
    assert last.item("gradient accumulators") == pytest.approx(4 * P2) and last.item("gradient carry") == 0
    assert any("zenflow.accumulate (auto): device" in n for n in last.notes)
    assert estimate(resolve_plan("llama2-7b", "alpaca", overrides=fixed),
                    Machine(tight.host_ram, True, "L4", 24 * GB)).accumulate == "host"  # no room on the device


def test_an_explicit_choice_is_kept_and_counted() -> None:
    plan = resolve_plan("llama2-7b", "alpaca", overrides=["zenflow.accumulate=device"])
    est = estimate(plan, Machine(512 * GB, True, "L4", 24 * GB))
    assert est.accumulate == "device" and not est.fits  # the user asked for it: the verdict says no
    assert est.item("gradient accumulator") == pytest.approx(4 * P2)
    with pytest.raises(ConfigError, match="zenflow.accumulate"):
        resolve_plan("llama2-7b", "alpaca", overrides=["zenflow.accumulate=gpu"])


@pytest.mark.parametrize(("nodes", "nproc"), [(2, 1), (1, 2)])
def test_the_release_line_counts_every_rank_of_the_job(nodes: int, nproc: int) -> None:
    """A data-parallel selection step reads every ``.grad`` (its scores are all-reduced), so the
    release does not bound the ``gradients`` line on more than one rank, wherever the ranks are:
    ``nodes 2, nproc 1`` is two ranks as much as ``nproc 2`` is."""
    m = Machine(512 * GB, True, "L4", 24 * GB)
    one = estimate(resolve_plan("llama2-7b", "alpaca"), m)
    assert one.item("gradients") == 2 * (32000 * 4096 + 65 * 4096)  # one process: the largest matrix's .grad
    plan = resolve_plan("llama2-7b", "alpaca", overrides=[f"distributed.nodes={nodes}", f"distributed.nproc={nproc}",
                                                          "distributed.strategy=zero2"])
    est = estimate(plan, m)
    assert est.world_size == 2 and est.accumulate == "host"
    assert est.item("gradients") == pytest.approx(2 * 6.738e9, rel=1e-3)  # w P: every .grad until step()
    assert "data parallel" in next(i.note for i in est.items if i.name == "gradients")
    # the host path's gradient slots whatever the release (it bounds only the device's .grad):
    # zero2 gives each of the 2 ranks half the host columns, the same slot sets
    assert est.host_accumulators == one.host_accumulators
    assert est.item("gradient slots") == pytest.approx(one.item("gradient slots") / 2, rel=0.01)
