"""What a checkpoint folder is: its file names, the keys of ``trainer.pt``, and its parsed form.

Every name here is part of the on-disk format: a checkpoint written by an earlier zfctl must keep
loading, so a name is added, never changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"  # under the run folder
LATEST = "latest"  # one-line pointer file in checkpoints/
META = "meta.json"
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
PLAN_FILE = "plan.yaml"

# meta.json's lineage keys (write.py): a random id per checkpoint, and the id of the run's
# checkpoint before it; missing in checkpoints written before them.
ID_KEY = "id"
PREVIOUS_KEY = "follows"

# The keys of trainer.pt, each named once (torchtune names its recipe-state keys the same way).
STEP_KEY = "step"  # optimizer steps done
TOKENS_SEEN_KEY = "tokens_seen"  # missing in early checkpoints: 0
LAST_LOSS_KEY = "last_loss"  # missing in early checkpoints: None
SCHEDULER_KEY = "scheduler"  # LambdaLR.state_dict()
SAMPLER_KEY = "sampler"  # SamplerPosition.to_dict(): the data position
NUM_TRAIN_SAMPLES_KEY = "num_train_samples"  # the training set's size, to refuse changed data
TRAIN_DIGEST_KEY = "train_digest"  # the training sequences' digest (PreparedData.train_digest); missing in early checkpoints
STEPS_PER_EPOCH_KEY = "steps_per_epoch"
VERSION_KEY = "zfctl_version"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def optimizer_file(rank: int) -> str:
    """The optimizer state file a save writes for ``rank`` (tensorfile.py format)."""
    return f"optimizer-rank{rank:05d}.safetensors"


def legacy_optimizer_file(rank: int) -> str:
    """The torch.save file of checkpoints written before the state was streamed."""
    return f"optimizer-rank{rank:05d}.pt"


def optimizer_file_in(info: CheckpointInfo, rank: int) -> str:
    """The name of ``rank``'s optimizer file in the checkpoint ``info`` (either format)."""
    legacy = legacy_optimizer_file(rank)
    return legacy if legacy in info.meta.get("files", {}) else optimizer_file(rank)


def model_shard_file(rank: int) -> str:
    """The model file of ``rank`` under ``distributed.strategy: fsdp`` (shards.py): that rank's
    FSDP2 shard of every parameter, in place of rank 0's whole ``model.safetensors``."""
    return f"model-rank{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


@dataclass
class CheckpointInfo:
    """A validated checkpoint folder and its ``meta.json``."""

    path: Path
    step: int
    world_size: int
    version: str
    meta: dict[str, Any]

    @property
    def shard_world(self) -> int:
        """How many model and optimizer files an fsdp checkpoint holds: ``meta.json``'s
        ``shard_world``, the shard group's size (HSDP: nproc, one replica writes; write.py);
        without it (flat fsdp, zero2, checkpoints written before it was recorded) the world size."""
        return int(self.meta.get("shard_world", self.world_size))
