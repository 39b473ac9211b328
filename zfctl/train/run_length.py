"""How long a run is, and what ``zfctl resume --max-steps`` may change about it.

The LR schedule of a ``cosine`` or ``linear`` run is a function of its length: the decay ends at
the last step. A resume that moves the end (``--max-steps``) would recompute the LR of later
steps on the stretched curve: at a finished demo run's step 119 the LR jumped from 7.7e-07 (step
118) to 8.72e-05, a re-warm, and the losses no longer continued as the run would have. That is a
change of the plan like any other: refused, with the LR before and after, unless
``--allow-changes`` (then the schedule is stretched to the new end, as torchtune and HF's Trainer
do on a longer resume). What is compared is the LR of every step still to run under the saved
schedule (past its end too, where cosine and linear are 0) and under the new one; only a
difference refuses, so a ``constant`` schedule, and steps that stay inside the LR warm-up (which
does not depend on the length), extend freely. The other choice, keeping the saved curve and
training on at its final LR (a constant tail), is no use for the common case, a finished cosine
run, whose final LR is ~0. Shortening is refused the same way (the decay would steepen).
"""

from __future__ import annotations

from zfctl.errors import UserError
from zfctl.plan.schema import RunPlan, TrainConfig
from zfctl.train import checkpoint as ck
from zfctl.train.data.sampler import ResumableSampler
from zfctl.train.schedule import lr_multiplier


def planned_steps(train: TrainConfig, num_train_samples: int, world_size: int) -> int:
    """The optimizer steps of a run: ``max_steps``, or ``epochs`` over the training set (as the
    training loop counts them, zfctl/train/recipe.py)."""
    if train.max_steps is not None:
        return int(train.max_steps)
    batches = ResumableSampler(num_train_samples, train.micro_batch_size, seed=0,
                               world_size=world_size).batches_per_epoch()
    return max(1, train.epochs * batches // train.gradient_accumulation_steps)


def run_length(info: ck.CheckpointInfo, plan: RunPlan, world_size: int) -> int | None:
    """The length of ``plan`` run on ``world_size`` processes over the training set ``info`` was
    saved with; None for a run by epochs whose checkpoint does not record that set's size."""
    if plan.train.max_steps is not None:
        return int(plan.train.max_steps)
    records = ck.load_torch(info, ck.TRAINER_FILE).get(ck.NUM_TRAIN_SAMPLES_KEY)
    return None if not records else planned_steps(plan.train, int(records), world_size)


def first_lr_change(train: TrainConfig, old: int, new: int, start: int) -> int | None:
    """The first 0-based step from ``start`` (the steps done) to ``new`` whose LR differs between
    a run of ``old`` and one of ``new`` steps; None when every one is the same."""
    if old == new or train.schedule == "constant":
        return None
    was, now = (lr_multiplier(train.schedule, train.warmup_steps, n) for n in (old, new))
    return next((s for s in range(start, new) if now(s) != was(s)), None)


def check_new_length(info: ck.CheckpointInfo, saved: RunPlan, max_steps: int, *,
                     allow_changes: bool) -> str | None:
    """Refuse a ``--max-steps`` that changes the LR of a step still to run, compared with the saved
    schedule (past its end too: a finished cosine run's schedule says 0 there), unless
    ``allow_changes``; with it, the note that says how the LR moves. None when no LR changes:
    a constant schedule, or steps that stay inside the LR warm-up, which does not depend on the
    run's length."""
    old = run_length(info, saved, info.world_size)
    t = saved.train
    changed = None if old is None else first_lr_change(t, old, max_steps, info.step)
    if old is None or changed is None:
        return None
    was, now = (lr_multiplier(t.schedule, t.warmup_steps, n) for n in (old, max_steps))
    what = (f"--max-steps {max_steps} moves the end of the {t.schedule} LR schedule from step {old}: "
            f"step {changed + 1} would train at lr {t.lr * now(changed):.3g} instead of {t.lr * was(changed):.3g}")
    if not allow_changes:
        raise UserError(f"{what}, so the losses would not continue as the run would have; pass "
                        "--allow-changes to train on that stretched schedule, or start a new run from an "
                        "export (train.schedule=constant runs extend freely)")
    return what + " (--allow-changes)"
