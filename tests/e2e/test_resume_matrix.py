"""The resume matrix docs/multi-gpu.md promises: a checkpoint of an fsdp or zero2 run on 4 processes,
taken during the warm-up, in the middle of a ZenFlow interval (a CPU update in flight) or at a
CPU-update boundary, continues on 4, 2 or 1 processes within 1e-5 relative of the uninterrupted
run (fp32, CPU, gloo).

One uninterrupted 4-process run per strategy is the reference, with a checkpoint after every step;
each case resumes a copy of the run folder from one of its checkpoints. A 1-process resume runs
in this process (``zfctl.train.resume``, what the CLI's one-process path calls); 2 and 4
processes go through the real ``zfctl resume --nproc N`` (torchrun). Under fsdp the checkpoint
holds 4 model shards; on 2 processes each rank reads the 2 holding its rows, on 1 process the run
continues unsharded (one process: nothing to shard, as zero2). Every case keeps the global batch
of 4 sequences (micro-batch 1 x accumulation 1 x 4 ranks -> x2 on 2, x4 on 1).

Tiny model, 13 steps, one thread per process: the two references and twelve torchrun launches
are most of the cost (start-up, not training).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
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
# saved true, ignored under fsdp): its gradients land in per-step slots and every path clips each
# step by its own factor (zfctl/offload/grads/slots.py), so it continues fsdp's run within 1e-5, from the
# warm-up and mid-interval too (before the slots: a landing ring that needed the clip factor
# before backward, and an interval-mean clip 5.8e-4 off at step 13).
CASES = [pytest.param(s, n, p) for s in ("fsdp", "zero2") for n in (4, 2, 1) for p in POINTS]


def _finetune(out: Path, strategy: str) -> None:
    sets = [a for s in [*RUN, f"distributed.strategy={strategy}"] for a in ("--set", s)]
    zfctl("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(out), "--nproc", "4", *sets,
          timeout=600)


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


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted 4-process run of each strategy, built the first time a case needs it."""
    root = tmp_path_factory.mktemp("matrix")

    class Lazy(dict):
        def __missing__(self, strategy: str) -> Path:
            self[strategy] = out = root / strategy
            _finetune(out, strategy)
            return out

    return Lazy()


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "nproc", "point"), CASES)
def test_a_checkpoint_continues_like_the_uninterrupted_run(references, tmp_path, strategy: str, nproc: int,
                                                            point: str):
    ref = references[strategy]
    straight = losses(ref)
    assert len(straight) == STEPS
    step = _points(ref)[point]
    copy = tmp_path / "run"
    shutil.copytree(ref, copy)
    ckpt = copy / f"checkpoints/step-{step:06d}"
    if nproc == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each torchrun rank runs (OMP_NUM_THREADS=1): a loaded 2-core box
        try:
            res = resume(ckpt)
        finally:
            torch.set_num_threads(threads)
        assert res.steps == STEPS
    else:
        log = zfctl("resume", str(ckpt), "--nproc", str(nproc), timeout=600)
        assert f"launching {nproc} processes under torchrun" in log, log
    resumed = losses(copy)
    assert resumed[:step] == straight[:step]  # the records before the checkpoint are kept as they were
    # the same world size rewrites the same losses bit for bit; another one sums in another order
    assert_close(resumed[step:], straight[step:], tol=0.0 if nproc == 4 else 1e-5)
