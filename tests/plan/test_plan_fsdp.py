"""The plan per GPU and per node (distributed.strategy, nproc x nodes; zfctl/plan/memory.py), and
the fsdp refusals that come before any process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zfctl.errors import ConfigError
from zfctl.plan import resolve_plan
from zfctl.plan.memory import GB, PROCESS_BASELINE, Machine, estimate

ACCEPTANCE = ["llama2-70b", "--data", "alpaca", "--gpu-memory", "80GB", "--host-memory", "1TB",
              "--set", "distributed.nproc=8", "--nodes", "2"]


def _zfctl(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "zfctl", *args], check=False, capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def test_llama2_70b_on_two_nodes_fits_under_fsdp() -> None:
    out = _zfctl("plan", *ACCEPTANCE)
    assert out.returncode == 0, out.stderr
    assert "it fits under fsdp (16 ranks)" in out.stdout
    for total in ("device total per GPU", "host total per rank", "host total per node"):
        assert total in out.stdout
    mem = json.loads(_zfctl("plan", *ACCEPTANCE, "--json").stdout)["memory"]
    assert (mem["strategy"], mem["world_size"], mem["ranks_per_node"]) == ("fsdp", 16, 8)
    assert mem["fits"]
    assert mem["node_host_total"] == pytest.approx(8 * mem["host_total"])
    weights = next(i for i in mem["items"] if i["name"] == "weights")
    assert weights["bytes"] == pytest.approx(2 * 68.977e9 / 16, rel=1e-6)  # bf16, 1/16 shard


def test_auto_keeps_zero2_where_the_model_fits_a_gpu_and_picks_fsdp_where_it_does_not() -> None:
    gpu = Machine(1000 * GB, True, "target GPU", 80 * GB)
    small = estimate(resolve_plan("llama2-7b", "alpaca", overrides=["distributed.nproc=8"]), gpu)
    assert small.strategy == "zero2" and small.fits
    big = resolve_plan("llama2-70b", "alpaca", overrides=["distributed.nproc=8", "distributed.nodes=2"])
    assert estimate(big, gpu).strategy == "fsdp"
    from dataclasses import replace

    zero2 = estimate(replace(big, distributed=replace(big.distributed, strategy="zero2")), gpu)
    assert not zero2.fits and any(r.startswith("device memory") for r in zero2.reasons)


def test_zero2_splits_the_host_state_and_fsdp_the_device_state() -> None:
    """One process vs zero2 vs fsdp on 4 ranks of 2 nodes: the host state per rank is a quarter
    under both; the weights and the selected state are a quarter under fsdp only."""
    base = ["train.precision=bf16", "zenflow.accumulate=host"]
    one = estimate(resolve_plan("tiny-llama", "alpaca-sample", overrides=base), Machine(64 * GB, False))
    four = [*base, "distributed.nproc=2", "distributed.nodes=2"]
    z2 = estimate(resolve_plan("tiny-llama", "alpaca-sample", overrides=[*four, "distributed.strategy=zero2"]),
                  Machine(64 * GB, False))
    fs = estimate(resolve_plan("tiny-llama", "alpaca-sample", overrides=[*four, "distributed.strategy=fsdp"]),
                  Machine(64 * GB, False))
    assert z2.item("fp32 master") == pytest.approx(one.item("fp32 master") / 4, rel=1e-3)
    assert fs.item("fp32 master") == pytest.approx(one.item("fp32 master") / 4, rel=1e-3)
    assert z2.item("weights") == one.item("weights")
    assert fs.item("weights") == pytest.approx(one.item("weights") / 4)
    assert fs.item("fsdp gathered parameters") > 0 and z2.item("fsdp gathered parameters") == 0
    assert z2.node_host_total == pytest.approx(2 * (z2.host_total + z2.device_total))  # no CUDA: RAM holds both


@pytest.mark.parametrize(("model", "nproc", "needle"), [
    ("tiny-llama", "3", "model.embed_tokens.weight"),  # by-row: sharded on dim 1 (hidden 256)
    ("llama2-70b", "3", "hidden_size (8192)"),  # known by model.arch only
])
def test_fsdp_world_size_that_does_not_divide_is_refused(model: str, nproc: str, needle: str) -> None:
    with pytest.raises(ConfigError, match="distributed.nproc") as e:
        resolve_plan(model, "alpaca-sample", overrides=["distributed.strategy=fsdp", f"distributed.nproc={nproc}"])
    assert needle in str(e.value)


def test_fsdp_refusals_are_one_line_exit_2_and_write_nothing(tmp_path) -> None:
    out = _zfctl("plan", "tiny-llama", "--data", "alpaca-sample", "--set", "distributed.strategy=fsdp",
                 "--set", "distributed.nproc=3")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("error: distributed.nproc=3")
    run = tmp_path / "run"
    out = _zfctl("finetune", "tiny-llama", "--data", "alpaca-sample", "--set", "distributed.strategy=fsdp",
                 "--nproc", "3", "-o", str(run), cwd=str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("error: distributed.nproc=3"), out.stderr
    assert "launching" not in out.stdout
    assert not run.exists()


def test_fsdp_node_host_total_holds_one_whole_model_while_the_ranks_load_in_turn() -> None:
    """zfctl/train/recipe.py: each rank of a node builds the whole model in host RAM in its turn;
    with everything on the GPU (topk_ratio 1) that load, beside the 8 processes' own baselines,
    is the node's host peak."""
    plan = resolve_plan("llama2-7b", "alpaca", overrides=["distributed.nproc=8", "distributed.strategy=fsdp",
                                                          "zenflow.topk_ratio=1", "train.device=cuda"])
    est = estimate(plan, Machine(1024 * GB, True, "H100", 80 * GB))
    whole = 2 * est.size.params
    assert est.node_host_total == pytest.approx(8 * PROCESS_BASELINE["cuda"] + whole + 7 * whole / 8)
    assert any(n.startswith("fsdp model load: the 8 ranks of a node") for n in est.notes), est.notes


def test_hsdp_shards_within_a_node_so_the_per_gpu_and_per_node_lines_divide_by_nproc() -> None:
    """distributed.hsdp: FSDP2 shards over the 8 ranks of a node and replicates across the 2
    nodes, so a GPU holds 1/8 of the weights (not 1/16) and a node's host the same as one 8-rank
    node of flat fsdp."""
    gpu = Machine(1024 * GB, True, "H100", 80 * GB)
    over = ["distributed.nproc=8", "distributed.nodes=2", "distributed.strategy=fsdp"]
    flat = estimate(resolve_plan("llama2-70b", "alpaca", overrides=over), gpu)
    hsdp = estimate(resolve_plan("llama2-70b", "alpaca", overrides=[*over, "distributed.hsdp=true"]), gpu)
    one_node = estimate(resolve_plan("llama2-70b", "alpaca", overrides=["distributed.nproc=8",
                                                                        "distributed.strategy=fsdp"]), gpu)
    assert hsdp.item("weights") == pytest.approx(2 * 68.977e9 / 8, rel=1e-6)  # bf16, 1/8 shard
    assert hsdp.item("weights") == pytest.approx(2 * flat.item("weights"), rel=1e-6)
    assert hsdp.item("fp32 master") == pytest.approx(one_node.item("fp32 master"))
    assert hsdp.device_total == pytest.approx(one_node.device_total)
    assert hsdp.node_host_total == pytest.approx(one_node.node_host_total)
    assert hsdp.node_host_total > flat.node_host_total
    assert (hsdp.world_size, hsdp.ranks_per_node) == (16, 8)
    assert any(n.startswith("distributed.hsdp: weights, gradients") for n in hsdp.notes), hsdp.notes


@pytest.mark.parametrize(("overrides", "needle"), [
    (["distributed.strategy=zero2", "distributed.nodes=2"], "set distributed.strategy: fsdp"),
    (["distributed.strategy=fsdp"], "distributed.nodes is 1"),
])
def test_hsdp_without_fsdp_or_on_one_node_is_refused(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match="distributed.hsdp") as e:
        resolve_plan("tiny-llama", "alpaca-sample", overrides=[*overrides, "distributed.hsdp=true"])
    assert needle in str(e.value)


def test_hsdp_needs_nproc_to_divide_the_sharded_dims_not_nproc_x_nodes() -> None:
    """3 x 2 = 6 ranks: flat fsdp and HSDP both refuse 3 (the shard group); 2 x 3 nodes shards
    over 2 under HSDP (accepted) where flat fsdp over 6 is refused."""
    with pytest.raises(ConfigError, match=r"distributed.nproc=3: .* over nproc = 3 ranks"):
        resolve_plan("tiny-llama", "alpaca-sample", overrides=["distributed.strategy=fsdp", "distributed.nproc=3",
                                                               "distributed.nodes=2", "distributed.hsdp=true"])
    over = ["distributed.strategy=fsdp", "distributed.nproc=2", "distributed.nodes=3"]
    with pytest.raises(ConfigError, match="over nproc x nodes = 6 ranks"):
        resolve_plan("tiny-llama", "alpaca-sample", overrides=over)
    assert resolve_plan("tiny-llama", "alpaca-sample", overrides=[*over, "distributed.hsdp=true"]).distributed.hsdp


def test_hsdp_refusal_is_one_error_line_exit_2(tmp_path) -> None:
    run = tmp_path / "run"
    out = _zfctl("finetune", "tiny-llama", "--data", "alpaca-sample", "--set", "distributed.strategy=fsdp",
                 "--set", "distributed.hsdp=true", "--nproc", "2", "-o", str(run), cwd=str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith("error: distributed.hsdp='true': HSDP replicates across nodes"), out.stderr
    assert "set distributed.nodes" in out.stderr and "launching" not in out.stdout and not run.exists()
