"""The real CLI under ``distributed.strategy: fsdp`` (torchrun, gloo on CPU): it trains like zero2,
writes one model shard per rank, and its checkpoints resume on another world size or strategy.
One 4-rank fsdp run and the shared 2-rank zero2 run (tests/conftest.py) are what every
test continues from: a run's cost is its processes' start-up, not its 6 tiny steps.

Both strategies run with their defaults: fsdp has no release path (the gradients arrive by
FSDP2's reduce-scatter, zfctl/offload/parallel/sharded.py) and zero2 releases them in their hooks, and both
take the one clip rule (the interval-mean rule on every path: docs/design.md, "Algorithm"), so on
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

# TINY (tests/e2e/test_distributed_cli.py): 6 steps, global batch 4, update boundaries at 2, 4, 6
# with the update installed one interval later (overlap), re-selection at step 5; a checkpoint
# every step, so that step 3 (one step into an interval, an update in flight) and step 1 (before
# the first boundary) are there to continue from.
FOUR = [*TINY, "train.micro_batch_size=1", "checkpoint.every=1", "checkpoint.keep_last=6",
        "distributed.strategy=fsdp"]


def resume_copy(run: Path, into: Path, step: int, *args: str) -> str:
    """Resume a copy of ``run`` from its checkpoint of ``step`` (``args``: --nproc, --strategy)."""
    shutil.copytree(run, into)
    return zfctl("resume", str(into / f"checkpoints/step-{step:06d}"), *args)


def meta(ckpt: Path) -> dict:
    return json.loads((ckpt / "meta.json").read_text())


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Path:
    """TINY on 4 fsdp ranks, micro-batch 1: the global batch of the shared zero2 run on 2 ranks
    (tests/conftest.py), and 4 shards to re-cut for 2 ranks and 1. Read only."""
    out = tmp_path_factory.mktemp("fsdp-cli") / "four"
    zfctl("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(out), "--nproc", "4",
          *[a for s in FOUR for a in ("--set", s)])
    return out


@pytest.mark.slow
def test_fsdp_trains_like_zero2_and_writes_one_model_shard_per_rank(four_ranks, two_process_run):
    """Needs the 4-rank fsdp run and the shared zero2 run on 2 ranks: the same global batches."""
    zero2 = two_process_run[0]
    fsdp = losses(four_ranks)
    assert len(fsdp) == 6
    assert_close(fsdp, losses(zero2), tol=1e-4)
    ckpt = four_ranks / "checkpoints/step-000006"
    assert sorted(p.name for p in ckpt.glob("model*")) == [f"model-rank{r:05d}.safetensors" for r in range(4)]
    assert meta(ckpt)["strategy"] == "fsdp" and meta(ckpt)["world_size"] == 4
    assert meta(zero2 / "checkpoints/step-000006")["strategy"] == "zero2"


@pytest.mark.slow
def test_fsdp_and_zero2_checkpoints_resume_under_the_other_strategy(four_ranks, two_process_run, tmp_path):
    """Saved at step 3 (an update in flight) and continued under the other strategy on 2 ranks
    (the fsdp run's 4 shards re-cut for 2 zero2 ranks; the zero2 run's state for 2 fsdp ranks):
    steps 4..6 match the uninterrupted run within 1e-4. Needs the two resumes, each on a copy."""
    log = resume_copy(four_ranks, tmp_path / "to-zero2", 3, "--strategy", "zero2", "--nproc", "2")
    assert "resuming under distributed.strategy zero2, saved under fsdp" in log, log
    assert_close(losses(tmp_path / "to-zero2")[3:], losses(four_ranks)[3:], tol=1e-4)
    assert meta(tmp_path / "to-zero2/checkpoints/step-000006")["strategy"] == "zero2"
    assert (tmp_path / "to-zero2/checkpoints/step-000006/model.safetensors").is_file()

    zero2 = two_process_run[0]
    resume_copy(zero2, tmp_path / "to-fsdp", 3, "--strategy", "fsdp")
    assert_close(losses(tmp_path / "to-fsdp")[3:], losses(zero2)[3:], tol=1e-4)
    assert meta(tmp_path / "to-fsdp/checkpoints/step-000006")["strategy"] == "fsdp"


@pytest.mark.slow
def test_fsdp_reshards_from_four_ranks_to_two_to_one(four_ranks, tmp_path):
    """The 4-rank run's step-1 checkpoint continued on 2 fsdp ranks (each reads the 2 saved shards
    holding its rows), and that continuation's step-3 checkpoint (an update in flight) on one
    process: each continuation's losses to step 6 within 1e-4 of the 4-rank run. Needs the two
    resumes, each on a copy."""
    straight = losses(four_ranks)
    log = resume_copy(four_ranks, tmp_path / "two", 1, "--nproc", "2")
    assert "train.gradient_accumulation_steps 1 -> 2 keeps the global batch of 4 sequences" in log, log
    assert_close(losses(tmp_path / "two")[1:], straight[1:], tol=1e-4)
    assert meta(tmp_path / "two/checkpoints/step-000003")["world_size"] == 2
    log = resume_copy(tmp_path / "two", tmp_path / "one", 3, "--nproc", "1")
    assert "launching" not in log
    assert_close(losses(tmp_path / "one")[3:], straight[3:], tol=1e-4)
    assert meta(tmp_path / "one/checkpoints/step-000006")["strategy"] == "zero2"  # one process: nothing to shard


@pytest.mark.slow
def test_resume_under_fsdp_on_a_world_size_that_does_not_divide_is_one_line(tmp_path):
    """3 processes keep a global batch of 6 but do not divide hidden_size 64: refused before any
    process starts, nothing written. The checkpoint: one step in this process (global batch 6)."""
    from zfctl.plan.resolve import resolve_plan
    from zfctl.train import run

    out = tmp_path / "six"
    run(resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        *TINY, "train.micro_batch_size=2", "train.gradient_accumulation_steps=3", "train.max_steps=1",
        f"checkpoint.output_dir={out}"]))
    ckpt = out / "checkpoints/step-000001"
    before = sorted(p.name for p in ckpt.parent.iterdir())
    for args, needle in ((["--nproc", "3", "--strategy", "fsdp"], "evenly over nproc x nodes = 3 ranks"),
                         (["--strategy", "fdsp"], "--strategy fdsp: use one of")):
        p = subprocess.run([sys.executable, "-m", "zfctl", "resume", str(ckpt), *args], check=False, cwd=ROOT,
                           env=ENV, text=True, capture_output=True, timeout=120)
        assert p.returncode == 2, (p.stdout, p.stderr)
        assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: "), p.stderr
        assert needle in p.stderr, p.stderr
        assert "launching" not in p.stdout
    assert sorted(p.name for p in ckpt.parent.iterdir()) == before
