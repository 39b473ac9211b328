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
  (``zfctl/offload/parallel/pieces.py``); each new rank reads the replicated part from one saved file and
  the pieces overlapping its own columns from the files that hold them, and verifies exactly
  those files' digests. Checkpoints of the older per-rank format resume on W processes only.
* **RNG.** Each rank restores the RNG state of the saved rank with its number, if there was one;
  other ranks keep the seed (models without dropout draw nothing from it while training).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Literal, cast

from zfctl.errors import UserError
from zfctl.offload.parallel.pieces import merge_states, owners
from zfctl.offload.parallel.sharded import shard_state, unshard_state
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
    """The run folder's ``plan.yaml`` in the checkpoint's process count and strategy, so that
    comparing the two finds what the user edited, not what an earlier resume on another count or
    strategy rewrote (nproc and the accumulation that kept the global batch; ``--strategy``).
    The count is kept when it cannot be mapped back."""
    edited = replace(edited, distributed=replace(edited.distributed, strategy=saved.distributed.strategy))
    n, m = edited.distributed.nproc, saved.distributed.nproc
    micro_batches = edited.train.gradient_accumulation_steps * n
    if n == m or micro_batches % m:
        return edited
    return replace(edited, train=replace(edited.train, gradient_accumulation_steps=micro_batches // m),
                   distributed=replace(edited.distributed, nproc=m))


STRATEGIES = ("zero2", "fsdp", "auto")  # distributed.strategy's values (zfctl/plan/schema.py)


def saved_strategy(info: ck.CheckpointInfo) -> str:
    """The strategy ``info`` was saved under: ``meta.json``'s ``strategy``; without it (checkpoints
    written before it was recorded) fsdp if the model is in shard files, else zero2."""
    return str(info.meta.get("strategy") or ("fsdp" if ck.is_sharded(info) else "zero2"))


def fit_strategy(plan: RunPlan, strategy: str | None) -> tuple[RunPlan, str | None]:
    """``plan`` with ``distributed.strategy`` = ``strategy`` (``zfctl resume --strategy``; None:
    kept), and a note saying what changed (None when nothing did)."""
    if strategy is not None and strategy not in STRATEGIES:
        raise UserError(f"--strategy {strategy}: use one of {', '.join(STRATEGIES)}")
    if strategy is None or strategy == plan.distributed.strategy:
        return plan, None
    fitted = replace(plan, distributed=replace(plan.distributed, strategy=cast(Literal["zero2", "fsdp", "auto"], strategy)))
    return fitted, f"resuming under distributed.strategy {strategy}, saved under {plan.distributed.strategy}"


def _fine_cut(saved: int, world: int, rank: int) -> tuple[int, range, range]:
    """Rows of every column cut into ``m = lcm(saved, world)`` equal parts (FSDP2 shards are equal
    and in rank order, and zfctl/train/fsdp.py check_shardable makes every row count divide by
    both world sizes, so by ``m``): saved rank ``o`` holds parts ``[o m/saved, (o+1) m/saved)``.
    Returns ``m``, the parts ``rank`` of ``world`` holds, and the saved ranks holding them."""
    m = math.lcm(saved, world)
    parts = range(rank * (m // world), (rank + 1) * (m // world))
    return m, parts, range(parts[0] // (m // saved), (parts[-1] // (m // saved)) + 1)


def model_files(info: ck.CheckpointInfo, rank: int, world: int, strategy: str) -> list[str]:
    """The model files of ``info`` that ``rank`` of ``world`` under ``strategy`` reads (what it
    verifies): ``model.safetensors``; or of W model shards, rank 0's (it also holds the tensors
    that are not sharded) and those holding this rank's rows (fsdp), or all of them (zero2,
    one process: the whole model)."""
    if not ck.is_sharded(info):
        return [ck.MODEL_FILE]
    saved = info.shard_world
    owners = range(saved) if strategy != "fsdp" or world == 1 else _fine_cut(saved, world, rank)[2]
    return [ck.model_shard_file(o) for o in sorted({0, *owners})]


def optimizer_files(info: ck.CheckpointInfo, rank: int, world: int, strategy: str) -> list[str] | None:
    """The optimizer files ``rank`` reads when resharding across strategies or fsdp world sizes
    (load_optimizer_state); None where the zero2 rule applies (this rank's file, or the owners of
    its columns, found from the files' ``partition``)."""
    saved, was = info.shard_world, saved_strategy(info)
    if was != "fsdp" and strategy != "fsdp":
        return None
    if was == strategy and saved == world:
        return None
    if was == "fsdp" and strategy == "fsdp":
        return [ck.optimizer_file_in(info, o) for o in _fine_cut(saved, world, rank)[2]]
    return [ck.optimizer_file_in(info, o) for o in range(saved)]  # every saved rank's rows or columns


def load_optimizer_state(optimizer: TrainingOptimizer, info: ck.CheckpointInfo, rank: int,
                         world: int, *, strategy: str = "zero2") -> None:
    """Load this rank's optimizer state from ``info``, re-cut when ``world`` or ``strategy``
    differs from the checkpoint's. zero2 -> zero2: the large tensors are read straight into the
    optimizer's buffers, piece by piece (zfctl/train/tensorfile.py). Across strategies or fsdp
    world sizes the state goes through one process's state (zfctl/offload/parallel/sharded.py): the files
    read are read whole into memory (:func:`_recut`). Raises UserError (one line) when the state
    does not fit. Under fsdp ``rank`` and ``world`` are the place in the shard group (HSDP: within
    a node), and an HSDP checkpoint is an fsdp checkpoint of its ``shard_world`` files."""
    saved = info.shard_world
    base = ck.optimizer_file_in(info, min(rank, saved - 1))  # the replicated part is the same in every file
    try:
        files = optimizer_files(info, rank, world, strategy)
        if files is not None:
            ck.verify_checkpoint(info, [f for f in files if f != ck.optimizer_file_in(info, rank)])
            optimizer.load_state_dict(_recut(optimizer, info, files, rank, world, strategy))
            return
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


def _recut(optimizer: TrainingOptimizer, info: ck.CheckpointInfo, files: list[str], rank: int, world: int,
           strategy: str) -> dict[str, Any]:
    """This rank's state from ``files`` (:func:`optimizer_files`), re-cut through
    zfctl/offload/parallel/sharded.py. Every file named is read whole into memory (its tensors are sliced
    along each column's elements, which a file range cannot give): fsdp W -> fsdp W' reads the
    saved ranks holding this rank's rows (W/W' of them when W' divides W; one when W divides W');
    fsdp -> zero2 and zero2 -> fsdp read every file, one process's state at once (in host RAM, for
    a moment, on every rank: the cost of changing the strategy)."""
    states = [ck.load_optimizer(info, f, lazy=False) for f in files]
    if any(st.get("format") == FORMAT_V1 for st in states):
        raise UserError(f"cannot resume {info.path} under another strategy: it was written by zfctl "
                        f"{info.version}, whose optimizer files cannot be re-cut; resume it as it was saved")
    was, saved = saved_strategy(info), info.shard_world
    if was == "fsdp" and strategy == "fsdp":  # rows [rank/world, (rank+1)/world) of every column
        m, parts, olds = _fine_cut(saved, world, rank)
        fine = []
        for o, st in zip(olds, states):  # each saved shard as m/saved parts; keep this rank's
            cut = shard_state(unshard_state([{**st, "fsdp_shard": [0, 1]}]), m // saved)
            fine += [f for i, f in enumerate(cut) if o * (m // saved) + i in parts]
        joined = unshard_state([{**f, "fsdp_shard": [i, len(fine)]} for i, f in enumerate(fine)])
        return {**joined, "fsdp_shard": [rank, world]}
    if was == "fsdp":  # -> zero2 / one process: one process's state, this rank's columns of it
        return merge_states([unshard_state(states)], optimizer.host_ranges())
    # zero2 -> fsdp: every saved rank's columns as one process's state, then this rank's rows
    every = [(p["name"], 0, p["c1"]) for st in states for p in st.get("host") or []]
    one = states[0] if len(states) == 1 else merge_states(states, every)
    return shard_state(one, world)[rank]
