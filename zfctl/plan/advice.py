"""Settings known to cost accuracy: the warnings `zfctl finetune` prints once before training.

Each rule is a measured finding (docs/accuracy.md; scripts/accuracy.py reproduces the
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
    if z.full_warm_up_rounds == 0 and deferred:
        start = "random init" if plan.model.source == "config" else "a new task"
        out.append(
            f"zenflow.full_warm_up_rounds=0: the first steps on {start} move every weight fast, and the "
            "deferred columns' update lands late and overshoots there; --set zenflow.full_warm_up_rounds=20 "
            "(the default) runs them as synchronous full CPU-offload steps (AdamW on every weight matrix)"
            + (" (a larger lr-scaled CPU step makes it worse)" if z.deferred_lr_scale != "off" else ""))
    if deferred and z.deferred_lr_scale == "off":
        out.append(
            "zenflow.deferred_lr_scale=off: the non-selected columns take one lr-sized Adam step per "
            "interval instead of one per step, so they learn up to update_interval times slower than "
            "under AdamW; --set zenflow.deferred_lr_scale=repeat (the default, with its warm-up)")
    epochs = z.select_epochs()
    if epochs is not None:
        per, span = ("epoch", "an epoch") if epochs == 1 else (f"{epochs} epochs", f"{epochs} epochs")
        out.append(
            f"zenflow.select_interval={z.select_interval}: the device columns are chosen once per {per} "
            f"(once in all, for runs shorter than {span}) while the important columns drift; "
            "--set zenflow.select_interval=8 re-chooses them every 8 steps (the default)")
    if z.vocab_select == "columns":
        out.append(
            "zenflow.vocab_select=columns: the embedding and output head update only their selected hidden "
            "dimensions each step, so the tokens a batch uses (a classifier's label words) "
            "mostly wait for the CPU update; --set zenflow.vocab_select=rows (the default) "
            "puts their rows on the device")
    return out


def short_run_warnings(plan: RunPlan) -> list[str]:
    """A run no longer than its warm-ups: ZenFlow never engages, or the LR never reaches train.lr.

    zfctl warns rather than shrinking the warm-ups itself: the plan printed is the run that runs,
    and a 10-step smoke test that quietly used other warm-ups than the long run it stands in for
    would test something else. The fix, with numbers, is in the line.
    """
    t, z = plan.train, plan.zenflow
    if t.max_steps is None:  # a run by epochs: its length is known once the data is
        return []
    steps, out = int(t.max_steps), []
    if 0.0 < float(z.topk_ratio) < 1.0 and z.full_warm_up_rounds >= steps:
        out.append(
            f"train.max_steps={steps} is within zenflow.full_warm_up_rounds={z.full_warm_up_rounds}: every "
            "step of this run is a synchronous full CPU-offload step (the CPU AdamW updates every weight "
            "matrix and the step waits; the step line's `sel 0.00`) and ZenFlow's overlapped split never "
            f"engages; --set zenflow.full_warm_up_rounds={steps // 5} to try ZenFlow in a short run")
    if t.warmup_steps >= steps:
        out.append(
            f"train.max_steps={steps} is within train.warmup_steps={t.warmup_steps}: the learning rate "
            f"never reaches train.lr={t.lr:g}; --set train.warmup_steps={steps // 10} for a short run")
    return out
