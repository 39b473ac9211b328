"""Settings known to cost accuracy: the warnings `zfctl finetune` prints once before training.

Each rule is a measured finding (README, section Accuracy; scripts/accuracy.py reproduces the
numbers), not a guess: a run that matches one still trains, it just learns less per step than
AdamW would. Pure functions of the plan, so `zfctl plan` and tests can ask too.
"""

from __future__ import annotations

from zfctl.plan.schema import RunPlan


def accuracy_warnings(plan: RunPlan) -> list[str]:
    """One line per setting of ``plan`` known to lose accuracy against AdamW at equal steps."""
    z = plan.zenflow
    if not 0.0 < float(z.topk_ratio) < 1.0:  # off (all device) or zero-offload: AdamW exactly
        return []
    out = []
    deferred = z.update_interval == "auto" or int(z.update_interval) > 1
    if plan.model.source == "config" and z.overlap_step and z.full_warm_up_rounds == 0:
        out.append(
            "random init with no full warm-up: while every weight moves fast, the deferred columns' "
            "update lands one interval late and overshoots (tiny-llama from scratch: +6.6% loss); "
            "set zenflow.full_warm_up_rounds to ~10% of the steps, e.g. --set zenflow.full_warm_up_rounds=20")
    if deferred and z.deferred_lr_scale == "off":
        out.append(
            "zenflow.deferred_lr_scale=off: the non-selected columns take one lr-sized Adam step per "
            "interval instead of one per step, so they learn up to update_interval times slower than "
            "under AdamW; --set zenflow.deferred_lr_scale=sqrt (the default preset) closes most of the gap")
    if z.select_strategy != "step":
        out.append(
            f"zenflow.select_strategy={z.select_strategy}: the device columns are chosen once per epoch "
            "(once in all, for runs shorter than an epoch) while the important columns drift; "
            "--set zenflow.select_strategy=step --set zenflow.select_interval=32 re-chooses them every 32 steps")
    return out
