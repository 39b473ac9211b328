"""The finished weights of a checkpoint, as ``zfctl export`` writes them and ``zfctl generate`` runs them.

The checkpoint's ``model.safetensors`` (or FSDP2 shard files, checkpoint/shards.py) holds the
weights as training left them; with ``overlap_step`` one CPU update may still be in flight inside
the optimizer state. :func:`final_weights` rebuilds the optimizer on the CPU, loads that state and
flushes it (under FSDP2: each rank's, on that rank's rows, :func:`install_sharded`), so the
weights are exactly the finished model (the one the final evaluation scored), not one interval
behind. (A module of its own: ``generate`` needs the weights, not the folder writer.)
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

from zfctl.errors import UserError
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


def final_weights_files(info: ck.CheckpointInfo) -> list[str]:
    """The files :func:`final_weights` reads first, for the caller to verify before it loads
    anything (a zero2 checkpoint's other optimizer files are verified as they are needed,
    world_size.py; an FSDP2 checkpoint's are all read)."""
    if ck.is_sharded(info):
        optimizer = [ck.optimizer_file_in(info, r) for r in range(len(ck.model_shard_files(info)))]
    else:
        optimizer = [ck.optimizer_file_in(info, 0)]
    return [ck.PLAN_FILE, *ck.model_files_in(info), ck.TRAINER_FILE, *optimizer]


def final_weights(info: ck.CheckpointInfo, plan: RunPlan) -> PreTrainedModel:
    """The checkpoint's model on the CPU, with any in-flight CPU update installed."""
    from zfctl.train.models.load import load_model
    from zfctl.train.optim import build_optimizer
    from zfctl.train.world_size import load_optimizer_state

    model = load_model(plan.model, precision=plan.train.precision, device=torch.device("cpu"),
                       seed=plan.train.seed)
    ck.load_model_weights(info, model)  # either layout (checkpoint/shards.py), one tensor at a time
    trainer = ck.load_torch(info, ck.TRAINER_FILE)
    steps_per_epoch = int(trainer.get(ck.STEPS_PER_EPOCH_KEY, 1))
    if ck.is_sharded(info):
        install_sharded(info, plan, model, steps_per_epoch)
        return cast("PreTrainedModel", model)
    # One process holds every host column: the pieces of all saved ranks are merged (as a resume
    # on one process would, world_size.py). Costs the optimizer's host memory briefly.
    opt = build_optimizer(model, plan, steps_per_epoch=steps_per_epoch)
    try:
        load_optimizer_state(opt, info, rank=0, world=1)
        opt.flush()
    finally:
        opt.close()
    return cast("PreTrainedModel", model)  # load_model builds transformers causal LMs only


def install_sharded(info: ck.CheckpointInfo, plan: RunPlan, model: torch.nn.Module, steps_per_epoch: int) -> None:
    """Install each FSDP2 rank's in-flight CPU update into ``model`` (whole weights, loaded).

    Rank r's optimizer stepped its local rows (zfctl/offload/parallel/sharded.py): an optimizer over
    copies of exactly those rows, under the same names, is the optimizer that saved rank r's
    state, so it loads that state as saved and ``flush`` installs what rank r would have; the
    rows go back into ``model``. One rank at a time: the extra memory is 1/W of the weights and
    one rank's optimizer state, never the W ranks' states together (``unshard_state``) nor a
    second model.
    """
    from zfctl.train.checkpoint.shards import index, stored_model, stored_name, tie_groups
    from zfctl.train.optim import build_optimizer

    stored = stored_model(info)
    world = len(stored.files)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    alias = tie_groups(dict(model.state_dict()))
    pieces = {n: stored.tensors[stored_name(stored, n, alias)].pieces for n, _ in trainable}
    for rank in range(world):
        name = ck.optimizer_file_in(info, rank)
        state = ck.load_optimizer(info, name)
        if [int(x) for x in state.get("fsdp_shard") or []] != [rank, world]:
            raise UserError(f"checkpoint {info.path} is unreadable: {name} is not the optimizer state of FSDP2 "
                            f"rank {rank} of {world} (its fsdp_shard is {state.get('fsdp_shard')}); pick another "
                            "checkpoint")
        if not state["counters"]["pending_install"]:
            # nothing in flight: flush would install nothing and loading writes no parameter
            # (offload/state.py), so the weights as loaded are final; no optimizer is built
            continue
        boxes = {n: pieces[n][rank][1] for n, _ in trainable}
        # trainable copies (the optimizer steps what requires grad), contiguous like a local shard
        rows = [(n, p.detach()[index(boxes[n])].contiguous().clone().requires_grad_(True)) for n, p in trainable]
        opt = build_optimizer(model, plan, steps_per_epoch=steps_per_epoch, params=rows)
        try:
            try:
                opt.load_state_dict({k: v for k, v in state.items() if k != "fsdp_shard"})
            except ValueError as e:
                raise UserError(f"checkpoint {info.path}: {name} does not fit its plan ({e})") from None
            opt.flush()
        finally:
            opt.close()
        with torch.no_grad():
            for (n, p), (_, local) in zip(trainable, rows):
                p[index(boxes[n])].copy_(local)
        # Free this rank's optimizer before the next one is built: the optimizer holds reference
        # cycles (its parts point back at it), which only the collector breaks, and until it runs
        # two ranks' states would be alive at once.
        del opt, rows, state
        gc.collect()
