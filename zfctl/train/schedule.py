"""Schedules: the learning rate of each step, and which steps log, evaluate and checkpoint.

The learning rate: linear warm-up, then cosine / linear decay or a constant.

The schedule is a ``torch.optim.lr_scheduler.LambdaLR`` so that it drives
``param_groups[i]["lr"]`` of any ``torch.optim.Optimizer`` (the ZenFlow optimizer included) and
its ``state_dict`` is the usual one. The multiplier is a pure function of the step, so a resumed
run reproduces the exact float the straight run used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

from zfctl.plan.schema import RunPlan

SCHEDULES = ("cosine", "linear", "constant")


def lr_multiplier(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The factor applied to the peak LR before optimizer step ``step`` (0-based).

    Warm-up ramps linearly from ``1/(warmup+1)`` (never exactly 0, so step 0 still learns) to 1.
    Decay runs from the end of warm-up to ``total_steps`` and reaches 0 at ``total_steps``
    (cosine, linear); ``constant`` stays at 1.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; use one of {', '.join(SCHEDULES)}")
    warmup_steps = max(0, int(warmup_steps))
    total_steps = max(1, int(total_steps))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if kind == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str, *, warmup_steps: int,
                    total_steps: int) -> LambdaLR:
    """A LambdaLR over ``optimizer`` implementing :func:`lr_multiplier`."""
    return LambdaLR(optimizer, lr_multiplier(kind, warmup_steps, total_steps))


def restore_scheduler(scheduler: LambdaLR, state: dict) -> None:
    """Restore the step counter from ``state`` and re-apply the LR it implies to the groups.

    The peak LR (``base_lrs``) and the multiplier come from the scheduler as built from the
    current plan, not from ``state``: an allowed plan change (``train.lr``, a longer
    ``max_steps``) takes effect on resume, and with no change the recomputed LR is the very
    float the straight run used (same expression, same inputs). ``LambdaLR.load_state_dict``
    alone would not touch ``param_groups``, so the first resumed step would use the LR of step 0.
    """
    state = {k: v for k, v in state.items() if k not in ("base_lrs", "_last_lr")}
    scheduler.load_state_dict(state)
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports; LambdaLR keeps it privately


@dataclass(frozen=True)
class Cadence:
    """Which optimizer steps of a run that goes from ``start`` to ``total`` log a console line,
    evaluate and checkpoint (``*_every`` 0: never inside the run).

    The last step is evaluated and checkpointed after the loop, not by these (its checkpoint comes
    first, then the in-flight CPU update is installed and the finished model evaluated).
    """

    start: int
    total: int
    log_every: int
    eval_every: int
    save_every: int

    @classmethod
    def of(cls, plan: RunPlan, *, start: int, total: int) -> Cadence:
        return cls(start=start, total=total, log_every=max(1, plan.logging.every),
                   eval_every=plan.train.eval_every, save_every=plan.checkpoint.every)

    def should_log(self, step: int) -> bool:
        """A console line: every ``log_every`` steps, and the first and last step of the run."""
        return step % self.log_every == 0 or step == self.start + 1 or step == self.total

    def should_eval(self, step: int) -> bool:
        return self.eval_every > 0 and step % self.eval_every == 0 and step < self.total

    def should_save(self, step: int) -> bool:
        return self.save_every > 0 and step % self.save_every == 0 and step < self.total
