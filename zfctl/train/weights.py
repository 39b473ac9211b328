"""The finished weights of a checkpoint, as ``zfctl export`` writes them and ``zfctl generate`` runs them.

The checkpoint's ``model.safetensors`` holds the weights as training left them; with
``overlap_step`` one CPU update may still be in flight inside the optimizer state.
:func:`final_weights` rebuilds the optimizer on the CPU, loads that state and flushes it, so the
weights are exactly the finished model (the one the final evaluation scored), not one interval
behind. (A module of its own: ``generate`` needs the weights, not the folder writer.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

from zfctl.plan.schema import RunPlan
from zfctl.train import checkpoint as ck

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Written into every export; --force replaces only folders that hold it.
EXPORT_MARKER = "zfctl-export.json"


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars (\"Writing model shards\", \"Loading weights\") off: zfctl
    prints its own one line, and a bar's carriage returns garble piped output."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def final_weights(info: ck.CheckpointInfo, plan: RunPlan) -> PreTrainedModel:
    """The checkpoint's model on the CPU, with any in-flight CPU update installed."""
    from zfctl.train.models.load import load_model
    from zfctl.train.optim import build_optimizer
    from zfctl.train.world_size import load_optimizer_state

    model = load_model(plan.model, precision=plan.train.precision, device=torch.device("cpu"),
                       seed=plan.train.seed)
    ck.load_model_weights(info, model)
    trainer = ck.load_torch(info, ck.TRAINER_FILE)
    # One process holds every host column: the pieces of all saved ranks are merged (as a resume
    # on one process would, world_size.py). Costs the optimizer's host memory briefly.
    opt = build_optimizer(model, plan, steps_per_epoch=int(trainer.get(ck.STEPS_PER_EPOCH_KEY, 1)))
    try:
        load_optimizer_state(opt, info, rank=0, world=1)
        opt.flush()
    finally:
        opt.close()
    return cast("PreTrainedModel", model)  # load_model builds transformers causal LMs only
