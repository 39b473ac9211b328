"""One clip rule on every path and strategy, through the real CLI (torchrun, gloo on CPU).

Every step's host-owned gradient lands in its own slot and the CPU update applies that step's
own clip factor (zfctl/offload/grads/slots.py), as the device columns, FSDP2 shards and the device path
always did; before the slots, zero2's default release path clipped an interval's host sum by the
interval's mean factor instead, and fsdp then differed from zero2 and from one process by 2.6e-3
relative at step 11, the first step after the first install. Here, with default
settings otherwise (release_grads on, max_grad_norm 1.0, which clips at every step of this random
init), two ranks under zero2, two under fsdp and one process with two accumulation steps see the
same global batches and must agree within 1e-5 relative, every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_distributed_cli import assert_close, losses, zfctl

SETS = ["train.precision=fp32", "zenflow.full_warm_up_rounds=2", "train.micro_batch_size=2", "zenflow.cpu_threads=1",
        "train.eval_every=0", "checkpoint.every=0"]


def finetune(out: Path, nproc: int, *extra: str) -> list[float]:
    sets = [a for s in [*SETS, *extra] for a in ("--set", s)]
    zfctl("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(out), "--nproc", str(nproc),
          "--max-steps", "12", *sets, timeout=900)
    return losses(out)


@pytest.mark.slow
def test_zero2_fsdp_and_one_process_clip_alike(tmp_path: Path) -> None:
    zero2 = finetune(tmp_path / "zero2", 2, "distributed.strategy=zero2")
    fsdp = finetune(tmp_path / "fsdp", 2, "distributed.strategy=fsdp")
    one = finetune(tmp_path / "one", 1, "train.gradient_accumulation_steps=2")
    assert len(zero2) == len(fsdp) == len(one) == 12
    assert_close(fsdp, zero2, tol=1e-5)
    assert_close(one, zero2, tol=1e-5)
