"""HSDP (``distributed.hsdp``): two ``torchrun`` "nodes" of 2 processes on 127.0.0.1 (gloo) shard
within a node and replicate across the two (zfctl/train/fsdp.py), lose what one process with the
same global batch loses, write one replica's 2 shards, and resume as HSDP again and as flat fsdp
on 2 ranks of one node with the losses of the uninterrupted run (docs/design.md, "ZenFlow on FSDP2 shards")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from test_distributed_cli import TINY, assert_close, losses, zfctl
from test_multinode import NODES, PER_NODE, two_nodes

# TINY's 6 steps, a checkpoint every 3: step 3 is one step into an update interval
# (update_interval 2), its CPU update in flight; re-selection at step 5 comes after the resume.
# fsdp has no release path, the one-process reference releases its gradients: every path takes
# the one clip rule (tests/e2e/test_clip_rule.py), so they agree to rounding.
HSDP = [*TINY, "train.micro_batch_size=1", "distributed.strategy=fsdp",
        f"distributed.nproc={PER_NODE}", f"distributed.nodes={NODES}", "distributed.hsdp=true"]


@pytest.mark.slow
def test_hsdp_two_nodes_match_one_process_and_resume_as_flat_fsdp_on_two_ranks(one_process_run: Path,
                                                                                 tmp_path: Path) -> None:
    """Needs one 2 x 2 HSDP run (the claim), the shared one-process run with micro-batch 4 (the same
    global batch, tests/conftest.py), a 2 x 2 resume and a 2-rank resume, each on a copy."""
    run = tmp_path / "hsdp"
    sets = [a for s in HSDP for a in ("--set", s)]
    two_nodes("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(run), *sets, rdzv_id="zfctl-hsdp")
    straight = losses(run)
    assert len(straight) == 6
    assert_close(straight, losses(one_process_run), tol=1e-4)  # 4 ranks, micro-batch 1 = one process, micro-batch 4

    # One replica's shards: model and optimizer files of shard ranks 0..1 (global ranks 0..1),
    # the RNG state of every rank; meta.json says the files are 2 shards of a 4-rank job.
    ckpt = run / "checkpoints/step-000003"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert (meta["world_size"], meta["shard_world"], meta["strategy"]) == (4, 2, "fsdp")
    names = sorted(p.name for p in ckpt.iterdir())
    assert [n for n in names if n.startswith(("model", "optimizer"))] == [
        "model-rank00000.safetensors", "model-rank00001.safetensors",
        "optimizer-rank00000.safetensors", "optimizer-rank00001.safetensors"]
    assert [n for n in names if n.startswith("rng")] == [f"rng-rank{r:05d}.pt" for r in range(4)]
    for r in range(2):
        with safe_open(str(ckpt / f"model-rank{r:05d}.safetensors"), "pt") as f:
            assert (f.metadata()["shard_rank"], f.metadata()["shard_world"]) == (str(r), "2")

    # Resumed as it ran (2 x 2 HSDP) from step 3: each rank reads its shard rank's files
    # (global ranks 2 and 3 those of 0 and 1) and its own RNG state; steps 4..6 continue.
    again = tmp_path / "hsdp-again"
    shutil.copytree(run, again)
    two_nodes("resume", str(again / "checkpoints/step-000003"), rdzv_id="zfctl-hsdp")
    assert_close(losses(again)[3:], straight[3:], tol=1e-4)

    # Resumed on 2 ranks of one node: flat fsdp over 2, the accumulation doubled for the global
    # batch of 4; steps 4..6 continue the uninterrupted HSDP run.
    flat = tmp_path / "flat"
    shutil.copytree(run, flat)
    log = zfctl("resume", str(flat / "checkpoints/step-000003"), "--nproc", "2")
    assert "train.gradient_accumulation_steps 1 -> 2 keeps the global batch of 4 sequences" in log, log
    resumed = losses(flat)
    assert resumed[:3] == straight[:3]
    assert_close(resumed[3:], straight[3:], tol=1e-4)
