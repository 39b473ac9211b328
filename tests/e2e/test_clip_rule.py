"""One clip rule on every path and strategy (gloo on CPU).

The interval-mean rule (docs/design.md, "Algorithm", step 1): the device columns take each step's
own clip factor, and every path's host-owned interval sum is raw, its CPU update scaled by the
interval's mean factor (zfctl/offload/cpu/pipeline.py ``clip_sum``), whether the gradients land in
slots from the hooks, the release path or step(), or reach the rank as FSDP2 shards; before the
slots, zero2's default release path alone took the interval mean, and fsdp then differed from
zero2 and from one process by 2.6e-3 relative at step 11, the first step after the first install.
Here, with release_grads on (the
default) and max_grad_norm 1.0 clipping every step of this random init (both asserted), four ranks
under zero2, four under fsdp and one process with four accumulation steps see the same global
batches and must agree within 1e-5 relative, every step.

The two 4-process runs are the resume matrix's uninterrupted references (tests/e2e/test_resume_matrix.py,
through the real ``zfctl finetune --nproc 4``), made once per session for both modules: its
schedule puts three steps of differing clip factors in each interval and two installs in the run.
Only the one-process run is this module's own, in this process, without checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from proc_helpers import one_thread
from test_distributed_cli import assert_close, losses
from test_resume_matrix import RUN, STEPS, reference

from zfctl.plan.io import load_plan_yaml
from zfctl.plan.resolve import resolve_plan
from zfctl.train import run
from zfctl.train.metrics import read_metrics


def _clipped_each_step(out: Path) -> None:
    plan = load_plan_yaml(out / "plan.yaml")
    assert plan.zenflow.tuning.release_grads and plan.train.max_grad_norm == 1.0, plan
    norms = [r["grad_norm"] for r in read_metrics(out / "metrics.jsonl", "train")]
    assert len(norms) == STEPS and min(norms) > 1.0, norms  # every step's factor below 1, each its own


@pytest.mark.slow
def test_zero2_fsdp_and_one_process_clip_alike(tmp_path_factory, tmp_path: Path) -> None:
    zero2, fsdp = reference(tmp_path_factory, "zero2"), reference(tmp_path_factory, "fsdp")
    one = tmp_path / "one"
    with one_thread():
        run(resolve_plan("tiny-llama", "alpaca-sample", overrides=[
            *RUN, "distributed.strategy=zero2", "train.gradient_accumulation_steps=4", "checkpoint.every=0",
            f"checkpoint.output_dir={one}"]))
    for out in (zero2, fsdp, one):
        _clipped_each_step(out)
    assert load_plan_yaml(fsdp / "plan.yaml").distributed.strategy == "fsdp"
    assert_close(losses(fsdp), losses(zero2), tol=1e-5)
    assert_close(losses(one), losses(zero2), tol=1e-5)
