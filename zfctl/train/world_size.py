"""Resuming on a different number of processes: the same global batch, the optimizer state re-cut.

A checkpoint written by W processes can be resumed by W' (``zfctl resume RUN --nproc W'``):

* **Global batch.** An optimizer step consumes ``micro_batch_size x gradient_accumulation_steps
  x world_size`` sequences. The micro-batch size is what fits in device memory, so it stays, and
  the accumulation absorbs the change: ``accum' = accum x W / W'``. When ``W'`` does not divide
  ``accum x W``, the resume is refused (one line listing the process counts that work) rather
  than silently training with another batch size. The plan that runs records ``accum'`` and
  ``distributed.nproc = W'``, so a later resume starts from what this one did.
* **Data position.** The sampler's position counts samples of the epoch's permutation
  (``data/sampler.py``), and a global micro-batch is ``micro x world`` consecutive samples, so
  every step draws exactly the samples it would have drawn on W processes. Where the training
  set does not fill whole global micro-batches, the sampler drops a different tail per world size
  (at most ``micro x world - 1`` samples per epoch), as any run with that world size would.
* **Optimizer state.** The host state is saved as pieces keyed by parameter name and column range
  (``zfctl/offload/pieces.py``); each new rank reads the replicated part from one saved file and
  the pieces overlapping its own columns from the files that hold them, and verifies exactly
  those files' digests. Checkpoints of the older per-rank format resume on W processes only.
* **RNG.** Each rank restores the RNG state of the saved rank with its number, if there was one;
  other ranks keep the seed (models without dropout draw nothing from it while training).
"""

from __future__ import annotations

from dataclasses import replace

from zfctl.errors import UserError
from zfctl.offload.pieces import merge_states, owners
from zfctl.offload.state import FORMAT_V1
from zfctl.plan.schema import RunPlan
from zfctl.train import checkpoint as ck
from zfctl.train.optim import TrainingOptimizer


def fit_world_size(plan: RunPlan, saved_world: int, world: int) -> tuple[RunPlan, str | None]:
    """``plan`` (written for ``saved_world`` processes) for ``world`` processes with the same
    global batch, and a note saying what changed (None when nothing did); UserError if impossible."""
    if saved_world == world:
        return plan, None
    t = plan.train
    micro_batches = t.gradient_accumulation_steps * saved_world  # per optimizer step, all ranks
    batch = t.micro_batch_size * micro_batches
    if micro_batches % world:
        fits = [n for n in range(1, micro_batches + 1) if micro_batches % n == 0]
        raise UserError(
            f"cannot resume on {world} process(es): the run's global batch is {batch} sequences "
            f"(train.micro_batch_size {t.micro_batch_size} x train.gradient_accumulation_steps "
            f"{t.gradient_accumulation_steps} x {saved_world} process(es)), and its {micro_batches} "
            f"micro-batches per step cannot be shared by {world}; resume with --nproc "
            f"{' / '.join(map(str, fits))}")
    accum = micro_batches // world
    fitted = replace(plan, train=replace(t, gradient_accumulation_steps=accum),
                     distributed=replace(plan.distributed, nproc=world))
    return fitted, (f"resuming on {world} process(es), saved on {saved_world}: "
                    f"train.gradient_accumulation_steps {t.gradient_accumulation_steps} -> {accum} keeps "
                    f"the global batch of {batch} sequences")


def as_saved_world(edited: RunPlan, saved: RunPlan) -> RunPlan:
    """The run folder's ``plan.yaml`` in the checkpoint's process count, so that comparing the two
    finds what the user edited, not what an earlier resume on another count rewrote (nproc and
    the accumulation that kept the global batch). Returned unchanged when that is not possible."""
    n, m = edited.distributed.nproc, saved.distributed.nproc
    micro_batches = edited.train.gradient_accumulation_steps * n
    if n == m or micro_batches % m:
        return edited
    return replace(edited, train=replace(edited.train, gradient_accumulation_steps=micro_batches // m),
                   distributed=replace(edited.distributed, nproc=m))


def load_optimizer_state(optimizer: TrainingOptimizer, info: ck.CheckpointInfo, rank: int,
                         world: int) -> None:
    """Load this rank's optimizer state from ``info``, re-cut when ``world`` differs from the
    checkpoint's. The large tensors are read straight into the optimizer's buffers, piece by
    piece (zfctl/train/tensorfile.py). Raises UserError (one line) when the state does not fit."""
    saved = info.world_size
    base = ck.optimizer_file_in(info, min(rank, saved - 1))  # the replicated part is the same in every file
    try:
        if saved == world:  # the same cut: this rank's own file (verified by the caller)
            optimizer.load_state_dict(ck.load_optimizer(info, base))
            return
        if base != ck.optimizer_file_in(info, rank):  # the caller verified this rank's own file only
            ck.verify_checkpoint(info, [base])
        state = ck.load_optimizer(info, base)
        ranges = (state.get("partition") or {}).get("ranges")
        if state.get("format") == FORMAT_V1 or ranges is None:
            raise UserError(f"cannot resume {info.path} on {world} process(es): it was written by zfctl "
                            f"{info.version}, whose optimizer files hold each process's share as is, which "
                            f"cannot be re-cut; resume with --nproc {saved}")
        wanted = optimizer.host_ranges()
        others = [ck.optimizer_file_in(info, o) for o in owners(ranges, wanted)]
        others = [f for f in others if f != base]
        ck.verify_checkpoint(info, others)  # only the files this rank reads
        optimizer.load_state_dict(merge_states([state, *(ck.load_optimizer(info, f) for f in others)], wanted))
    except ValueError as e:  # the state does not fit this model/plan (e.g. a changed topk_ratio)
        raise UserError(f"checkpoint {info.path}: its optimizer state does not fit this plan ({e}); "
                        "undo the change or start a new run") from None
