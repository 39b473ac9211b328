"""Decide once: the plan resolves every `auto` for the machine it names, the run builds that and
only checks the machine still holds it (zfctl/plan/settle.py, holds.py, zfctl/train/optim.py).

CUDA is faked through torch.cuda's functions (no GPU here): ``this_machine`` reads the card the
process trains on, the run's check reads ``torch.cuda.mem_get_info`` of its own device. No model
is trained: what the run would build is ``build_optimizer``'s input, caught before any allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import widen_consoles
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import UserError
from zfctl.plan import dump_plan_yaml, load_plan_yaml, resolve_plan
from zfctl.plan import machine as machine_mod
from zfctl.plan.fit import fit_or_fail
from zfctl.plan.holds import check_holds
from zfctl.plan.machine import GB, process_memory_cap
from zfctl.plan.memory import CUDA_CONTEXT, estimate
from zfctl.plan.settle import adopt_resolved, settle, unsettled
from zfctl.train.optim import build_optimizer

# A 542M-parameter Llama (tiny-llama widened): its device path fits a 141 GB card, not a 5 GB one,
# where the host path does; its host path's second accumulator fits 20 GB of RAM, not 16.
WIDE = ["model.config.hidden_size=2048", "model.config.intermediate_size=5632", "model.config.num_hidden_layers=8",
        "model.config.num_attention_heads=16", "model.config.num_key_value_heads=16", "model.config.vocab_size=32000",
        "train.precision=bf16", "train.device=cuda", "train.micro_batch_size=1", "data.max_length=256"]
H200 = 141 * GB


@dataclass
class FakeCuda:
    """torch.cuda as a process sees it: per-device total and free memory, a per-process fraction."""

    totals: list[float]
    free: list[float]
    fraction: float = 1.0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        c = torch.cuda
        monkeypatch.setattr(c, "is_available", lambda: True)
        monkeypatch.setattr(c, "device_count", lambda: len(self.totals))
        monkeypatch.setattr(c, "current_device", lambda: 0)
        monkeypatch.setattr(c, "get_device_properties",
                            lambda i: SimpleNamespace(name="NVIDIA H200", total_memory=int(self.totals[_index(i)])))
        monkeypatch.setattr(c, "mem_get_info", lambda i=None: (int(self.free[_index(i)]), int(self.totals[_index(i)])))
        monkeypatch.setattr(c, "memory_reserved", lambda i=None: 0)
        monkeypatch.setattr(c, "get_per_process_memory_fraction", lambda i=None: self.fraction)
        # The plan's torch-free probe (zfctl/gpu_probe.py) sees no driver here: it must ask torch.
        monkeypatch.setattr(machine_mod, "no_cuda_reason", lambda: None)


def _index(i: object) -> int:
    return int(getattr(i, "index", None) or 0) if not isinstance(i, int) else i


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """One idle 141 GB card, 256 GB of RAM free, no process cap."""
    fake = FakeCuda([H200], [H200 - CUDA_CONTEXT])
    fake.install(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(machine_mod, "process_memory_cap", lambda: None)
    monkeypatch.setattr("zfctl.offload.cpu.host.available_ram", lambda: 256 * GB)
    return fake


def built_config(monkeypatch: pytest.MonkeyPatch, plan):
    """The ZenFlowConfig ``build_optimizer`` hands the engine for ``plan`` (nothing allocated)."""
    import zfctl.offload

    seen = {}

    class Catch:
        def __init__(self, params, config, **kwargs) -> None:
            seen["config"] = config

    monkeypatch.setattr(zfctl.offload, "ZenFlowOptimizer", Catch)
    build_optimizer(torch.nn.Linear(4, 4), plan, steps_per_epoch=10)
    return seen["config"]


def test_a_plan_for_a_5gb_card_builds_the_host_path_on_a_141gb_one(h200: FakeCuda, monkeypatch) -> None:
    """An out-of-memory seen on an H200: `zfctl plan --gpu-memory 5.3GB --fit` said host, the run
    re-decided for the physical 141 GB card and built the device accumulator. The plan's answer
    is in the plan now, and the run builds it: the check passes (the card is larger than planned)."""
    plan = settle(fit_or_fail(resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        *WIDE, "machine.gpu_memory=5GB", "machine.host_memory=256GB"])).plan)
    assert plan.zenflow.accumulate == "host" and plan.zenflow.tuning.host_accumulators == 2
    assert not unsettled(plan)
    big = settle(resolve_plan("tiny-llama", "alpaca-sample", overrides=WIDE))  # this machine: the 141 GB card
    assert big.zenflow.accumulate == "host"  # the host layouts come first (layouts.py), whatever the card
    assert check_holds(plan, torch.device("cuda", 0)).accumulate == "host"
    config = built_config(monkeypatch, plan)
    assert config.accumulate == "host" and config.tuning.host_accumulators == 2


def test_a_capped_process_plans_for_its_cap_and_builds_that(h200: FakeCuda, monkeypatch) -> None:
    """A process capped to 5 GB of the 141 GB card (torch's per-process fraction, as
    scripts/zf_memstats.py --cap-gpu-memory emulates a smaller card) plans for 5 GB and builds the
    host path, though mem_get_info says 141 GB are free. A host capped at 16 GB (cgroup / RLIMIT)
    plans one host accumulator, though MemAvailable says 256 GB."""
    h200.fraction = 5 * GB / H200
    assert machine_mod.this_machine().gpu_mem == pytest.approx(5 * GB)
    plan = settle(resolve_plan("tiny-llama", "alpaca-sample", overrides=[*WIDE, "machine.host_memory=256GB"]))
    assert plan.zenflow.accumulate == "host"
    check_holds(plan, torch.device("cuda", 0))  # the cap is what was planned for: it holds
    assert built_config(monkeypatch, plan).accumulate == "host"

    h200.fraction = 1.0
    monkeypatch.setattr(machine_mod, "process_memory_cap", lambda: 16 * GB)
    assert machine_mod.this_machine().host_ram == 16 * GB
    capped = settle(resolve_plan("tiny-llama", "alpaca-sample", overrides=[*WIDE, "machine.gpu_memory=5GB"]))
    roomy = settle(resolve_plan("tiny-llama", "alpaca-sample", overrides=[*WIDE, "machine.gpu_memory=5GB",
                                                                          "machine.host_memory=32GB"]))
    assert (capped.zenflow.tuning.host_accumulators, roomy.zenflow.tuning.host_accumulators) == (1, 2)
    assert built_config(monkeypatch, capped).tuning.host_accumulators == 1


def test_a_gpu_smaller_than_planned_is_one_line_naming_both_sizes(h200: FakeCuda, monkeypatch) -> None:
    """The free memory of the GPU this rank trains on (LOCAL_RANK 1, not GPU 0) is checked, against
    the plan made for the 141 GB card: GPU 1 with 5.5 GB free (a shared card) cannot hold the device
    path (6.1 GB), it holds the host path (3.1 GB)."""
    plan = settle(resolve_plan("tiny-llama", "alpaca-sample", overrides=[*WIDE, "zenflow.accumulate=device"]))
    assert plan.zenflow.accumulate == "device"
    fake = FakeCuda([H200, H200], [H200 - CUDA_CONTEXT, 5.5 * GB])
    fake.install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert machine_mod.local_cuda_index() == 1
    check_holds(plan, torch.device("cuda", 0))  # GPU 0 is idle: it holds
    with pytest.raises(UserError) as err:
        check_holds(plan, torch.device("cuda", 1))
    line = str(err.value)
    assert "\n" not in line and line.startswith("this machine cannot hold the plan: device memory")
    assert "the plan needs 6.06 GB per GPU (planned for 141.0 GB), cuda:1 has 6.00 GB" in line, line
    assert "--gpu-memory 6.0GB --fit" in line and "--set zenflow.accumulate=host (2.17 GB less" in line, line
    host = settle(resolve_plan("tiny-llama", "alpaca-sample", overrides=[*WIDE, "zenflow.accumulate=host"]))
    check_holds(host, torch.device("cuda", 1))
    with pytest.raises(UserError, match=r"set zenflow.accumulate: host in runs/x/plan.yaml .* --allow-changes"):
        check_holds(plan, torch.device("cuda", 1), resume="runs/x")


def test_a_capped_host_is_refused_through_the_cli_with_one_line(tmp_path: Path, monkeypatch) -> None:
    """`zfctl finetune` planned for a 64 GB host in a process capped at 0.3 GB: exit 2, one
    `error:` line naming the planned and found sizes, no run folder."""
    widen_consoles(monkeypatch)
    monkeypatch.setattr(machine_mod, "process_memory_cap", lambda: 0.3 * GB)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["finetune", "tiny-llama", "--data", "alpaca-sample", "--host-memory", "64GB",
                                      "--set", "train.device=cpu", "--max-steps", "40", "--output", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: this machine cannot hold the plan: host RAM: the plan needs "), lines[0]
    assert "(planned for 64.0 GB, 49.0 GB usable), this machine has 0.30 GB (the process's memory cap" in lines[0]
    assert "--host-memory 0.3GB --fit" in lines[0]
    assert not out.exists()


def test_the_plan_records_its_answers_and_resume_reads_them_back(h200: FakeCuda, tmp_path: Path) -> None:
    """plan.yaml holds host/device, the layout, 1/2, the staging cap and whether release applies;
    a plan.yaml of an earlier zfctl that says auto still loads, settles once, and is the same
    plan as a run folder's plan.yaml that a later resume settled."""
    roomy = [*WIDE, "machine.host_memory=256GB"]  # two slot sets and a resume's carry, whatever this box has
    plan = settle(resolve_plan("tiny-llama", "alpaca-sample", overrides=roomy))
    z = plan.zenflow
    assert (z.accumulate, z.tuning.grad_layout, z.tuning.host_accumulators, z.tuning.release_grads) == (
        "host", "slots", 2, True)
    assert (plan.train.precision, plan.train.activation_checkpointing) == ("bf16", False)
    dump_plan_yaml(plan, tmp_path / "plan.yaml")
    text = (tmp_path / "plan.yaml").read_text()
    assert "  accumulate: host\n" in text and "    host_accumulators: 2\n" in text
    assert "    grad_layout: slots\n" in text and "    staging_mb: " in text and "staging_mb: auto" not in text
    assert "    release_grads: true\n" in text
    assert load_plan_yaml(tmp_path / "plan.yaml") == plan
    old = resolve_plan("tiny-llama", "alpaca-sample", overrides=roomy)  # what an earlier zfctl saved
    assert unsettled(old) and old.zenflow.accumulate == "auto"
    assert settle(old) == plan
    adopted = adopt_resolved(old, plan)  # the checkpoint's auto, beside the run folder's answers: no edit
    assert not unsettled(adopted) and adopted.zenflow.accumulate == "host" and settle(adopted) == plan
    assert adopt_resolved(plan, old) == plan  # an answer is never replaced by an auto


def test_release_is_recorded_off_only_where_the_plans_own_settings_rule_it_out() -> None:
    """release_grads frees gradients in the hook path's hooks: off in the plan under accumulate:
    device or update_interval: auto; kept where the world size decides (fsdp), since a resume
    may change it. An old ``--set zenflow.tuning.stream_grads=false`` is dropped (legacy.py): it
    no longer turns release off."""
    def rel(*sets: str) -> bool:
        return settle(resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.device=cpu", *sets])
                      ).zenflow.tuning.release_grads

    assert rel() and rel("zenflow.topk_ratio=1.0", "zenflow.accumulate=device")
    assert not rel("zenflow.accumulate=device") and rel("zenflow.tuning.stream_grads=false")
    assert not rel("zenflow.update_interval=auto")
    assert rel("distributed.nproc=2", "distributed.strategy=fsdp")
    notes: list[str] = []
    settle(resolve_plan("tiny-llama", "alpaca-sample", overrides=["zenflow.accumulate=device"]), notes=notes)
    assert notes == [("zenflow.tuning.release_grads: false, nothing to release (accumulate: device sums the "
                      "host columns on the device)")]


def test_the_process_baseline_and_cuda_context_are_lines() -> None:
    """Counted in the totals (and so in the verdict and --fit): 2 GB of host per process with CUDA,
    0.45 GB without, and the CUDA context on each GPU."""
    plan = resolve_plan("llama2-7b", "alpaca")
    gpu = estimate(plan, machine_mod.Machine(512 * GB, True, "gpu", 80 * GB))
    cpu = estimate(resolve_plan("llama2-7b", "alpaca", overrides=["train.device=cpu"]),
                   machine_mod.Machine(512 * GB, False))
    assert gpu.item("process baseline") == 2 * GB and gpu.item("CUDA context") == 0.5 * GB
    assert cpu.item("process baseline") == 0.45 * GB and cpu.item("CUDA context") == 0
    assert gpu.host_total == pytest.approx(sum(i.bytes for i in gpu.items if i.where == "host"))
    two = estimate(resolve_plan("llama2-7b", "alpaca", overrides=["distributed.nproc=2", "distributed.strategy=zero2"]),
                   machine_mod.Machine(512 * GB, True, "gpu", 80 * GB))
    assert two.item("process baseline") == 2 * GB and two.node_host_total == pytest.approx(2 * two.host_total)


def test_process_memory_cap_reads_cgroups_and_rlimits(tmp_path: Path, monkeypatch) -> None:
    """The smallest limit of this process's cgroup and those above it, v2 and v1; "max" and v1's
    2^63 are no limit."""
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    (root / "a" / "memory.max").write_text(f"{64 * 2**30}\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert process_memory_cap(str(root), str(proc)) == 64 * 2**30
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{8 * 2**30}\n")
    proc.write_text("4:memory:/job\n0::/\n")
    assert process_memory_cap(str(v1), str(proc)) == 8 * 2**30
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert process_memory_cap(str(v1), str(proc)) is None
    monkeypatch.setattr(resource, "getrlimit", lambda which: (3 * 2**30, resource.RLIM_INFINITY))
    assert process_memory_cap(str(v1), str(proc)) == 3 * 2**30
