"""The resume matrix docs/multi-gpu.md promises: a checkpoint of an fsdp or zero2 run on 4 processes,
taken during the warm-up, in the middle of a ZenFlow interval (a CPU update in flight) or at a
CPU-update boundary, continues on 4, 2 or 1 processes within 1e-5 relative of the uninterrupted
run (fp32, CPU, gloo).

One uninterrupted 4-process run per strategy, through the real ``zfctl finetune --nproc 4``
(torchrun), is the reference, with a checkpoint after every step, so that all three points come
from one run; it is made once per test session (tests/e2e/test_clip_rule.py reads the same two
runs). Each case resumes a copy of the run folder holding its one checkpoint. A 1-process resume
runs in this process (``zfctl.train.resume``, what the CLI's one-process path calls). The 2- and
4-process resumes run ``zfctl.train.resume`` on ranks spawned here, what each torchrun rank of
``zfctl resume --nproc N`` calls: the three points of a strategy and a process count one after
another in one process group, so 4 groups start instead of 12 torchrun jobs (the launcher path
itself is tests/e2e/test_distributed_cli.py's and test_fsdp_cli.py's). Under fsdp the checkpoint
holds 4 model shards; on 2 processes each rank reads the 2 holding its rows, on 1 process the run
continues unsharded (one process: nothing to shard, as zero2). Every case keeps the global batch
of 4 sequences (micro-batch 1 x accumulation 1 x 4 ranks -> x2 on 2, x4 on 1).

Tiny 2-layer model, 13 steps (the schedule below needs them: three warm-up steps, two boundaries
after them and an install after the second), one thread per process: process start-up is most
of the cost, not training.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from proc_helpers import one_thread, rendezvous, shared_run, spawn_ranks
from test_distributed_cli import TINY, assert_close, losses, zfctl

from zfctl.train import resume
from zfctl.train.metrics import read_metrics

STEPS = 13
# Warm-up steps 1..3 (each a synchronous full CPU step), then a CPU update every 3 steps,
# overlapped (installed one interval later), re-selection every 6 steps; max_grad_norm 1.0 (the
# tiny-llama preset's) clips every step of this random-init model, so the clip rule is exercised.
RUN = [*TINY, f"train.max_steps={STEPS}", "checkpoint.every=1", f"checkpoint.keep_last={STEPS}",
       "train.micro_batch_size=1", "train.gradient_accumulation_steps=1", "zenflow.full_warm_up_rounds=3",
       "zenflow.update_interval=3", "zenflow.select_interval=6", "zenflow.overlap_step=true"]
POINTS = ("warm-up", "mid-interval", "boundary")
# An fsdp checkpoint continued on one process runs the zero2 hook path with release_grads (the
# saved true, ignored under fsdp): its gradients land in per-step slots and every path takes the
# one clip rule (the interval-mean rule: zfctl/offload/cpu/pipeline.py), so it continues fsdp's run
# within 1e-5, from the warm-up and mid-interval too (before the slots: a landing ring that needed
# the clip factor before backward, and zero2's release path alone on an interval-mean clip, 5.8e-4
# off fsdp's per-step one at step 13).
CASES = [pytest.param(s, n, p) for s in ("fsdp", "zero2") for n in (4, 2, 1) for p in POINTS]


def reference(factory: pytest.TempPathFactory, strategy: str) -> Path:
    """The uninterrupted 4-process run of ``strategy`` (a checkpoint after every step), made the
    first time a test of this session asks for it."""

    def finetune(out: Path) -> None:
        sets = [a for s in [*RUN, f"distributed.strategy={strategy}"] for a in ("--set", s)]
        log = zfctl("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(out), "--nproc", "4",
                    *sets, timeout=600)
        assert "launching 4 processes under torchrun" in log, log

    return shared_run(factory, f"matrix-{strategy}", finetune)


def _points(run: Path) -> dict[str, int]:
    """The checkpoint step of each point, read from the reference's own records (so a change of
    the schedule cannot quietly move a case to another kind of step)."""
    recs = read_metrics(run / "metrics.jsonl", "train")
    warm = [r["step"] for r in recs if r["warmup"]]
    after = [r for r in recs if not r["warmup"]]
    boundaries = [r["step"] for r in after if r["boundary"]]
    assert len(warm) == 3 and len(boundaries) >= 2, recs
    # mid-interval: the step after a boundary (its update in flight, an interval begun); boundary:
    # a later boundary, with steps and an install still to run after it
    return {"warm-up": warm[1], "mid-interval": boundaries[0] + 1, "boundary": boundaries[1]}


def _branch(ref: Path, step: int, into: Path) -> Path:
    """A copy of run folder ``ref`` with only its step-``step`` checkpoint (the others are not read);
    returns that checkpoint's folder in the copy."""
    name = f"step-{step:06d}"
    shutil.copytree(ref, into, ignore=lambda d, names: [n for n in names if n.startswith("step-") and n != name])
    return into / "checkpoints" / name


def _resume_ranks(rank: int, phases: list[tuple[int, str, list[str]]]) -> None:
    """Rank ``rank`` of each ``zfctl resume --nproc world`` of ``phases`` (world, rendezvous,
    checkpoints), as a torchrun rank runs it: torchrun's variables, one thread (as zfctl gives each
    torchrun rank), a gloo process group per phase; the ranks a phase does not need wait for the end."""
    torch.set_num_threads(1)
    for world, init, ckpts in phases:
        if rank >= world:
            continue
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        try:
            for ckpt in ckpts:
                assert resume(Path(ckpt)).steps == STEPS, ckpt
        finally:
            dist.destroy_process_group()


def _resume_all(factory: pytest.TempPathFactory, out: Path, nproc: int) -> None:
    """Into ``out``: a copy of each reference resumed from each point on ``nproc`` processes,
    ``{strategy}-{nproc}-{point}``; for 2 or 4, both (the ranks of one spawned set of 4)."""
    phases = []
    for world in (4, 2) if nproc > 1 else (1,):
        ckpts = [str(_branch(ref, step, out / f"{strategy}-{world}-{point}"))
                 for strategy in ("fsdp", "zero2") for ref in [reference(factory, strategy)]
                 for point, step in _points(ref).items()]
        (out / f"rendezvous-{world}").mkdir()
        phases.append((world, rendezvous(out / f"rendezvous-{world}"), ckpts))
    if nproc > 1:
        spawn_ranks(_resume_ranks, 4, (phases,), timeout=900, what="the 4- and 2-process resumes")
        return
    with one_thread():
        for ckpt in phases[0][2]:
            assert resume(Path(ckpt)).steps == STEPS, ckpt


def resumed(factory: pytest.TempPathFactory, strategy: str, nproc: int, point: str) -> Path:
    """The copy of ``strategy``'s reference resumed from ``point`` on ``nproc`` processes. The first
    2- or 4-process case makes all twelve of those (process start-up and the first run's imports
    are most of a resume's cost: paid once, by one set of 4 spawned ranks, 2 of which then do the
    2-process ones); the first 1-process case makes the six 1-process ones, in this process."""
    key = "matrix-spawned" if nproc > 1 else "matrix-one"
    return shared_run(factory, key, lambda out: _resume_all(factory, out, nproc)) / f"{strategy}-{nproc}-{point}"


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "nproc", "point"), CASES)
def test_a_checkpoint_continues_like_the_uninterrupted_run(tmp_path_factory, strategy: str, nproc: int, point: str):
    ref = reference(tmp_path_factory, strategy)
    straight = losses(ref)
    assert len(straight) == STEPS
    step = _points(ref)[point]
    resumed_run = resumed(tmp_path_factory, strategy, nproc, point)
    assert read_metrics(resumed_run / "metrics.jsonl", "train")[-1]["step"] == STEPS
    resumed_losses = losses(resumed_run)
    assert resumed_losses[:step] == straight[:step]  # the records before the checkpoint are kept as they were
    # the same world size rewrites the same losses bit for bit; another one sums in another order
    assert_close(resumed_losses[step:], straight[step:], tol=0.0 if nproc == 4 else 1e-5)
