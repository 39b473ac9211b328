"""Crash-safe checkpoints: ``OUTPUT/checkpoints/step-XXXXXX/``, a ``latest`` pointer, rotation.

A checkpoint folder holds everything a run needs to continue on the same trajectory:

| file | content |
| --- | --- |
| ``model.safetensors`` | model weights as the optimizer left them (tied tensors stored once) |
| ``model-rankRRRRR.safetensors`` | instead, under ``distributed.strategy: fsdp``: that rank's FSDP2 shard of the weights (shards.py) |
| ``optimizer-rankRRRRR.safetensors`` | the optimizer's full state_dict (ZenFlow: selection, device and host masters and moments, counters, unfinished-interval accumulators, auto-interval statistics, loss scaler), streamed from the live buffers (tensorfile.py); checkpoints written before that hold ``optimizer-rankRRRRR.pt`` (torch.save), which still loads |
| ``rng-rankRRRRR.pt`` | torch CPU/CUDA, Python and NumPy RNG states of that rank |
| ``trainer.pt`` | step, LR-scheduler state, data position, the run's counters (keys in format.py) |
| ``plan.yaml`` | the resolved run plan |
| ``meta.json`` | zfctl version, step, world size, the checkpoint's ``id`` and the one it ``follows``, every file's size and xxh3-128 digest: written last |

One module per job; this package re-exports their public names (``from zfctl.train import
checkpoint as ck; ck.save_checkpoint(...)``):

* format.py: the file names, the keys of ``trainer.pt``, :class:`CheckpointInfo`;
* write.py: the multi-rank save protocol, atomic installation, ``latest``, rotation, and what a
  second stop signal makes of a save in progress;
* find.py: listing, resolving a path to a checkpoint (the one saved after ``latest``'s, when a
  kill kept ``latest`` from moving), digest checks (*listed* vs *intact*);
* load.py: model weights, optimizer state and torch files back into the run;
* shards.py: model weights as FSDP2 shards, one file per rank, read into any layout;
* space.py: the free-space check before a run and before each save, stale-folder cleaning;
* rng.py: the RNG state of one rank.

With ``overlap_step`` the model weights alone are one CPU update behind what the run would
export (that update is in flight inside the optimizer state); ``zfctl export`` installs it.
"""

from __future__ import annotations

from zfctl.train.checkpoint.find import (
    damaged_files,
    nearest_intact,
    newest_listed,
    older_checkpoint_fix,
    read_checkpoint,
    resolve_checkpoint,
    resume_with,
    saved_after,
    use_checkpoint_with,
    verify_checkpoint,
)
from zfctl.train.checkpoint.format import (
    CHECKPOINTS,
    LAST_LOSS_KEY,
    LATEST,
    META,
    MODEL_FILE,
    NUM_TRAIN_SAMPLES_KEY,
    PLAN_FILE,
    SAMPLER_KEY,
    SCHEDULER_KEY,
    STEP_KEY,
    STEPS_PER_EPOCH_KEY,
    TOKENS_SEEN_KEY,
    TRAIN_DIGEST_KEY,
    TRAINER_FILE,
    VERSION_KEY,
    CheckpointInfo,
    legacy_optimizer_file,
    model_shard_file,
    optimizer_file,
    optimizer_file_in,
    rng_file,
    step_name,
)
from zfctl.train.checkpoint.load import load_model_weights, load_optimizer, load_torch
from zfctl.train.checkpoint.rng import capture_rng, restore_rng
from zfctl.train.checkpoint.shards import (
    full_tensors,
    is_sharded,
    model_files_in,
    model_shard_files,
    save_model_shard,
)
from zfctl.train.checkpoint.space import (
    OPTIMIZER_BYTES_PER_PARAM,
    check_free_space,
    check_run_space,
    clean_stale,
    estimate_bytes,
    last_size,
)
from zfctl.train.checkpoint.write import Abandoned, abandon_save, rotate, save_checkpoint

__all__ = [
    "CHECKPOINTS", "LAST_LOSS_KEY", "LATEST", "META", "MODEL_FILE", "NUM_TRAIN_SAMPLES_KEY",
    "OPTIMIZER_BYTES_PER_PARAM", "PLAN_FILE", "SAMPLER_KEY", "SCHEDULER_KEY", "STEPS_PER_EPOCH_KEY",
    "STEP_KEY", "TOKENS_SEEN_KEY", "TRAINER_FILE", "TRAIN_DIGEST_KEY", "VERSION_KEY", "Abandoned",
    "CheckpointInfo", "abandon_save", "capture_rng",
    "check_free_space", "check_run_space", "clean_stale", "damaged_files", "estimate_bytes", "full_tensors",
    "is_sharded", "last_size", "legacy_optimizer_file", "load_model_weights", "load_optimizer", "load_torch",
    "model_files_in", "model_shard_file", "model_shard_files", "nearest_intact", "newest_listed",
    "older_checkpoint_fix", "optimizer_file", "optimizer_file_in", "read_checkpoint", "resolve_checkpoint", "restore_rng", "resume_with", "rng_file",
    "rotate", "save_checkpoint", "save_model_shard", "saved_after", "step_name", "use_checkpoint_with", "verify_checkpoint",
]
