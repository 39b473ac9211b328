"""Where a run stands: its counters, what ``trainer.pt`` holds, what a step and a run report.

``trainer.pt`` is the loop's part of a checkpoint: :class:`Progress` (step, tokens seen, last
loss), the LR scheduler's state, the data position and two facts to check on resume (the
training set's size, the steps per epoch). Its keys are named once, in
zfctl/train/checkpoint/format.py; :func:`trainer_state` writes them and :func:`read_trainer_state`
reads them back, so save and load cannot drift apart.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zfctl import __version__
from zfctl.errors import UserError
from zfctl.offload.cpu.pipeline import StateNote
from zfctl.train import checkpoint as ck
from zfctl.train.data.sampler import SamplerPosition
from zfctl.train.schedule import restore_scheduler
from zfctl.train.world_size import load_optimizer_state

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LambdaLR

    from zfctl.offload import StepStats
    from zfctl.train.optim import TrainingOptimizer


@dataclass
class RunResult:
    """What a finished (or already finished) run reports to the CLI."""

    output_dir: Path
    steps: int
    final_train_loss: float | None
    final_eval_loss: float | None
    last_checkpoint: Path | None
    already_finished: bool = False  # a resume found the run at its last step: nothing was trained


@dataclass
class StepResult:
    """What one optimizer step reports to the loop; every rank holds the same loss, tokens, stop."""

    loss: float  # the mean over ranks
    lr: float  # the LR the step used
    tokens: int  # attention-mask tokens of the step, summed over ranks
    step_ms: float  # wall clock of the whole step, data included
    stats: StepStats  # the optimizer's account of it
    stopping: bool  # some rank received a stop signal


@dataclass
class Progress:
    """Where the run stands; restored from ``trainer.pt``, advanced by the loop, saved with it."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # totals continue across resumes
    last_loss: float | None = None  # the last step's loss (reported if no step is left to run)

    def state_dict(self) -> dict[str, Any]:
        return {ck.STEP_KEY: self.step, ck.TOKENS_SEEN_KEY: self.tokens_seen, ck.LAST_LOSS_KEY: self.last_loss}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Progress:
        """From ``trainer.pt``; checkpoints older than the token and loss counters start them at 0/None."""
        return cls(step=int(state[ck.STEP_KEY]), tokens_seen=int(state.get(ck.TOKENS_SEEN_KEY, 0)),
                   last_loss=state.get(ck.LAST_LOSS_KEY))


@dataclass
class Restore:
    """What a checkpoint holds for the parts ``FinetuneRecipe.setup`` builds."""

    checkpoint: ck.CheckpointInfo  # the model weights are read from it straight into the model
    sampler: SamplerPosition
    scheduler: dict[str, Any]
    rng: dict[str, Any] | None  # None: the checkpoint has no RNG file for this rank

    def install(self, optimizer: TrainingOptimizer, scheduler: LambdaLR, *, rank: int, world_size: int,
                strategy: str = "zero2", note: Callable[[str], None] | None = None) -> None:
        """Put the optimizer, scheduler and RNG state into the freshly built parts, RNG last:
        nothing may draw from it after the restore. ``note``: prints what the optimizer says
        about the loaded state (``StateNote``, once, rank 0)."""
        # This rank's columns (zero2) or rows (fsdp), from whichever saved ranks' files hold them
        # (re-cut when the world size or strategy changed); a state that does not fit this plan
        # is a one-line UserError.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", StateNote)
            load_optimizer_state(optimizer, self.checkpoint, rank, world_size, strategy=strategy)
        for w in caught:
            if not issubclass(w.category, StateNote) or note is None:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            elif rank == 0:
                note(str(w.message))
        restore_scheduler(scheduler, self.scheduler)
        if self.rng is not None:
            ck.restore_rng(self.rng)


def trainer_state(progress: Progress, *, scheduler: dict[str, Any], sampler: SamplerPosition,
                  num_train_samples: int, steps_per_epoch: int, train_digest: str) -> dict[str, Any]:
    """``trainer.pt`` of a checkpoint saved at ``progress.step``."""
    return {**progress.state_dict(), ck.SCHEDULER_KEY: scheduler, ck.SAMPLER_KEY: sampler.to_dict(),
            ck.NUM_TRAIN_SAMPLES_KEY: num_train_samples, ck.STEPS_PER_EPOCH_KEY: steps_per_epoch,
            ck.TRAIN_DIGEST_KEY: train_digest, ck.VERSION_KEY: __version__}


def read_trainer_state(info: ck.CheckpointInfo, *, rank: int, num_train_samples: int,
                       train_digest: Callable[[], str], allow_changes: bool = False,
                       note: Callable[[str], None] = lambda line: None) -> tuple[Progress, Restore]:
    """``trainer.pt`` and ``rank``'s RNG file of ``info`` (verified by the caller).

    Refuses training data with another number of records than the checkpoint's: its data
    position would be meaningless. Refuses the same number of records with other content (an
    edited file, another template or tokenizer: ``train_digest()`` differs from the saved one)
    unless ``allow_changes``, which continues on the new data with a ``note``. Checkpoints
    written before the digest was saved are checked by their record count only.
    """
    trainer = ck.load_torch(info, ck.TRAINER_FILE)
    saved = trainer.get(ck.NUM_TRAIN_SAMPLES_KEY)
    if saved not in (None, num_train_samples):
        raise UserError(
            f"the training data changed since the checkpoint ({saved} records "
            f"then, {num_train_samples} now): the data position would be meaningless; restore the data or "
            "start a new run")
    digest = trainer.get(ck.TRAIN_DIGEST_KEY)
    if digest is not None and digest != train_digest():
        what = (f"the training data changed since the checkpoint {info.path}: the same {num_train_samples} "
                "records, other tokens (the data file was edited, or its template or tokenizer changed)")
        if not allow_changes:
            raise UserError(f"{what}; restore the data, or pass --allow-changes to continue on the new data")
        note(f"{what}; continuing on the new data (--allow-changes)")
    rng = ck.rng_file(rank)
    restore = Restore(checkpoint=info, sampler=SamplerPosition.from_dict(trainer[ck.SAMPLER_KEY]),
                      scheduler=trainer[ck.SCHEDULER_KEY],
                      rng=ck.load_torch(info, rng) if (info.path / rng).exists() else None)
    return Progress.from_state_dict(trainer), restore
