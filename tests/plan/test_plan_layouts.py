"""The host gradient layouts as the plan chooses, shows, fits and refuses them (zfctl/plan/layouts.py).

Numbers from the presets alone (no torch, no network): llama2-7b on a 48 GB GPU and a 128 GB host
(113 GB usable) holds the fp32 carry (12 + 4 B per host element) but not one set of 4 bf16 slots
(12 + 8 B); tiny-llama on this CPU with a 1.12 GB host (0.84 GB usable) the same, in fp32.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.offload.sizing import OUT_BYTES, STAGE_BYTES
from zfctl.plan import resolve_plan
from zfctl.plan.layouts import STAGING_SHARE
from zfctl.plan.memory import GB, Machine, estimate
from zfctl.plan.settle import settle

M48_128 = Machine(128 * GB, True, "gpu", 48 * GB)
P2 = 6.738e9 - (2 * 32 + 1) * 4096  # llama2-7b's 2-D weights: its host elements
TINY = ["tiny-llama", "--data", "alpaca-sample", "--host-memory", "1.12GB", "--set", "train.device=cpu",
        "--set", "train.activation_checkpointing=true"]


def seven_b(*sets: str, machine: Machine = M48_128):
    return estimate(resolve_plan("llama2-7b", "alpaca", overrides=list(sets)), machine)


def test_auto_takes_the_fastest_layout_the_host_holds_and_says_what_it_costs() -> None:
    carry = seven_b()
    assert (carry.accumulate, carry.grad_layout, carry.host_accumulators) == ("host", "carry", 1) and carry.fits
    assert carry.item("gradient carry") == pytest.approx(4 * P2) and carry.item("landing ring") == 4 * 32 * 2**20
    note = next(n for n in carry.notes if n.startswith("zenflow.tuning.grad_layout (auto)"))
    assert note.startswith("zenflow.tuning.grad_layout (auto): carry, 4 B per host element per interval")
    assert "slots, 2 sets (16 B, 107.8 GB); slots, 1 set (8 B, 53.9 GB)" in note
    two = seven_b(machine=Machine(512 * GB, True, "gpu", 48 * GB))
    assert (two.grad_layout, two.host_accumulators) == ("slots", 2)
    assert "16 B per host element per interval" in next(i.note for i in two.items if i.name == "gradient slots")
    assert any("a resume inside an interval under slots" in n for n in two.notes)  # transient, not a line
    assert two.resume_carry == pytest.approx(4 * P2) and two.item("checkpoint interval sum") == 0
    # update_interval auto sizes auto_max_interval (16) slots per set: bounded by the host
    assert seven_b("zenflow.update_interval=auto", machine=Machine(256 * GB, True, "gpu", 48 * GB)).grad_layout == "carry"
    assert seven_b("zenflow.update_interval=auto", machine=Machine(1024 * GB, True, "gpu", 48 * GB)).grad_layout == "slots"


def test_settle_records_the_layout_and_the_staging_cap() -> None:
    plan = settle(resolve_plan("llama2-7b", "alpaca", overrides=["machine.gpu_memory=48GB",
                                                                 "machine.host_memory=128GB"]))
    tu = plan.zenflow.tuning
    assert (plan.zenflow.accumulate, tu.grad_layout, tu.host_accumulators) == ("host", "carry", 1)
    assert isinstance(tu.staging_mb, float) and 64 <= tu.staging_mb < 2048


def test_the_out_buffer_takes_a_share_of_what_the_host_spares() -> None:
    """``staging_mb: auto``: one packed piece, grown by ``STAGING_SHARE`` of the host's spare after
    every other line, in whole MiB, at most every leaving row (capped at 2 GiB)."""
    floor = seven_b("zenflow.tuning.staging_mb=64")
    spare = 113 * GB - floor.node_host_total
    auto = seven_b()
    want = math.floor((STAGE_BYTES + STAGING_SHARE * spare) / 2**20)
    assert auto.staging_mb == want and 64 < want < OUT_BYTES / 2**20
    assert auto.item("selection staging") - floor.item("selection staging") == want * 2**20 - STAGE_BYTES
    assert f"at most {want} MiB" in next(i.note for i in auto.items if i.name == "selection staging")
    roomy = seven_b(machine=Machine(1024 * GB, True, "gpu", 48 * GB))
    assert roomy.staging_mb == 2048 and roomy.item("selection staging") - floor.item("selection staging") == (
        OUT_BYTES - STAGE_BYTES)
    given = seven_b("zenflow.tuning.staging_mb=256")
    assert given.staging_mb == 256 and given.item("selection staging") == floor.item("selection staging") + 192 * 2**20


@pytest.mark.parametrize("verb", ["plan", "finetune"])
def test_slots_the_host_cannot_hold_is_one_error_line_naming_carry(verb: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [verb, *TINY, "--set", "zenflow.tuning.grad_layout=slots", "--max-steps", "2",
                                      "--output", str(out)])
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: zenflow.tuning.grad_layout=slots: this host cannot hold the gradient slots "
                           "(0.08 GB, 16 B per host element per interval): the plan needs 0.86 GB of host RAM, "
                           "0.84 GB of 1.12 GB may be used; grad_layout carry (4 B per host element per interval, "
                           "host 0.82 GB) fits: --set zenflow.tuning.grad_layout=carry"), line
    assert not out.exists()
    fine = CliRunner().invoke(app, ["plan", *TINY])  # auto: the carry, and it fits
    assert fine.exit_code == 0 and "grad_layout (auto): carry" in fine.stdout


def test_fit_moves_a_fixed_layout_first_and_says_what_it_costs() -> None:
    args = ["plan", "llama2-7b", "--data", "alpaca", "--gpu-memory", "48GB", "--host-memory", "128GB",
            "--set", "zenflow.tuning.grad_layout=slots", "--set", "zenflow.tuning.host_accumulators=2"]
    fitted = CliRunner().invoke(app, [*args, "--fit"])
    assert fitted.exit_code == 0 and "--fit changed: --set zenflow.tuning.grad_layout=carry\n" in fitted.stdout
    from zfctl.plan.fit import fit

    plan = resolve_plan("llama2-7b", "alpaca", overrides=["machine.gpu_memory=48GB", "machine.host_memory=128GB",
                                                          "zenflow.tuning.grad_layout=slots",
                                                          "zenflow.tuning.host_accumulators=2"])
    [change] = fit(plan).changes
    assert change.cost == ("gradient layout carry: 4 B per host element per interval on the host (was 16 B): "
                           "speed only")


def test_a_host_smaller_than_planned_is_told_the_carry() -> None:
    """The run's check (holds.py) on a host smaller than the plan's: re-plan, or the carry, which
    holds 4 B per host element where two sets of 4 bf16 slots hold 16."""
    from zfctl.plan.holds import _host_fix

    est = seven_b(machine=Machine(512 * GB, True, "gpu", 48 * GB))
    assert (est.grad_layout, est.host_accumulators) == ("slots", 2)
    fix = _host_fix(resolve_plan("llama2-7b", "alpaca"), est, 150 * GB, None)
    assert fix == ("re-plan for it: --host-memory 150.0GB --fit, or --set zenflow.tuning.grad_layout=carry "
                   f"(about {(16 - 4) * P2 / GB:.1f} GB less)")
