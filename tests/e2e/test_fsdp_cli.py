"""The real CLI under ``distributed.strategy: fsdp`` (torchrun, gloo on CPU): it trains like zero2,
writes one model shard per rank, and its checkpoints resume on another world size or strategy.

Both strategies run with their defaults: fsdp has no release path (the gradients arrive by
FSDP2's reduce-scatter, zfctl/offload/parallel/sharded.py) and zero2 releases them in their hooks, and both
clip every step by its own factor (one rule on every path: docs/design.md, "Algorithm"), so on
this tiny model, where every step clips, they agree to rounding.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed_cli import ENV, ROOT, TINY, assert_close, losses, zfctl

# Global batch 6 (1 x 3 x 2 ranks) so that a resume on 3 processes keeps it and reaches the fsdp
# check; ZenFlow boundaries every 3 steps with the update installed one interval later (overlap),
# selections at 8, 16, 24: the checkpoint of step 10 is one step into an interval, an update in flight.
RUN = [*TINY, "train.max_steps=30", "checkpoint.every=10", "checkpoint.keep_last=5", "train.micro_batch_size=1",
       "train.gradient_accumulation_steps=3", "zenflow.update_interval=3", "zenflow.select_interval=8"]


def finetune(out: Path, nproc: int, strategy: str, extra: tuple[str, ...] = ()) -> str:
    sets = [a for s in [*RUN, f"distributed.strategy={strategy}", *extra] for a in ("--set", s)]
    return zfctl("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(out), "--nproc", str(nproc),
                 *sets)


def resume_copy(run: Path, into: Path, step: int, *args: str) -> str:
    """Resume a copy of ``run`` from its checkpoint of ``step`` (``args``: --nproc, --strategy)."""
    shutil.copytree(run, into)
    return zfctl("resume", str(into / f"checkpoints/step-{step:06d}"), *args)


def meta(ckpt: Path) -> dict:
    return json.loads((ckpt / "meta.json").read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """30 steps on 2 ranks under fsdp and under zero2 (the same global batches)."""
    out = tmp_path_factory.mktemp("fsdp-cli")
    finetune(out / "fsdp", 2, "fsdp")
    finetune(out / "zero2", 2, "zero2")
    return out


@pytest.mark.slow
def test_fsdp_trains_like_zero2_and_writes_one_model_shard_per_rank(two_ranks):
    fsdp, zero2 = losses(two_ranks / "fsdp"), losses(two_ranks / "zero2")
    assert len(fsdp) == len(zero2) == 30
    assert_close(fsdp, zero2, tol=1e-4)
    ckpt = two_ranks / "fsdp/checkpoints/step-000030"
    assert sorted(p.name for p in ckpt.glob("model*")) == ["model-rank00000.safetensors",
                                                           "model-rank00001.safetensors"]
    assert meta(ckpt)["strategy"] == "fsdp" and meta(ckpt)["world_size"] == 2
    assert meta(two_ranks / "zero2/checkpoints/step-000030")["strategy"] == "zero2"


@pytest.mark.slow
def test_fsdp_and_zero2_checkpoints_resume_under_the_other_strategy(two_ranks, tmp_path):
    """Saved at step 10 (an update in flight) and continued under the other strategy on 2 ranks:
    the 10 losses after the checkpoint match the uninterrupted run within 1e-4."""
    log = resume_copy(two_ranks / "fsdp", tmp_path / "to-zero2", 10, "--strategy", "zero2")
    assert "resuming under distributed.strategy zero2, saved under fsdp" in log, log
    assert_close(losses(tmp_path / "to-zero2")[10:20], losses(two_ranks / "fsdp")[10:20], tol=1e-4)
    assert meta(tmp_path / "to-zero2/checkpoints/step-000020")["strategy"] == "zero2"
    assert (tmp_path / "to-zero2/checkpoints/step-000020/model.safetensors").is_file()

    resume_copy(two_ranks / "zero2", tmp_path / "to-fsdp", 10, "--strategy", "fsdp")
    assert_close(losses(tmp_path / "to-fsdp")[10:20], losses(two_ranks / "zero2")[10:20], tol=1e-4)
    assert meta(tmp_path / "to-fsdp/checkpoints/step-000020")["strategy"] == "fsdp"


@pytest.mark.slow
def test_fsdp_reshards_from_four_ranks_to_two_to_one(tmp_path):
    """One 4-rank run (the uninterrupted reference, checkpoints every 2 steps); its step-2
    checkpoint continued on 2 fsdp ranks (each reads the 2 saved shards holding its rows), and
    that run's step-4 checkpoint on one process: each continuation's next 10 losses within 1e-4."""
    four = tmp_path / "four"
    short = ("train.max_steps=14", "checkpoint.every=2", "checkpoint.keep_last=10", "train.gradient_accumulation_steps=1")
    finetune(four, 4, "fsdp", short)
    straight = losses(four)
    assert len(straight) == 14
    log = resume_copy(four, tmp_path / "two", 2, "--nproc", "2")
    assert "train.gradient_accumulation_steps 1 -> 2 keeps the global batch of 4 sequences" in log, log
    assert_close(losses(tmp_path / "two")[2:12], straight[2:12], tol=1e-4)
    log = resume_copy(tmp_path / "two", tmp_path / "one", 4, "--nproc", "1")
    assert "launching" not in log
    assert_close(losses(tmp_path / "one")[4:14], straight[4:14], tol=1e-4)
    assert meta(tmp_path / "one/checkpoints/step-000014")["strategy"] == "zero2"  # one process: nothing to shard


@pytest.mark.slow
def test_resume_under_fsdp_on_a_world_size_that_does_not_divide_is_one_line(two_ranks):
    """3 processes keep the global batch of 6 but do not divide hidden_size 64: refused before
    any process starts, nothing written."""
    ckpt = two_ranks / "zero2/checkpoints/step-000030"
    before = sorted(p.name for p in ckpt.parent.iterdir())
    for args in (["--nproc", "3", "--strategy", "fsdp"], ["--strategy", "fdsp"]):
        p = subprocess.run([sys.executable, "-m", "zfctl", "resume", str(ckpt), *args], check=False, cwd=ROOT,
                           env=ENV, text=True, capture_output=True, timeout=120)
        assert p.returncode == 2, (p.stdout, p.stderr)
        assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: "), p.stderr
        assert "launching" not in p.stdout
    assert sorted(p.name for p in ckpt.parent.iterdir()) == before
