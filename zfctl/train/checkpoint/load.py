"""Reading a checkpoint's files into the run: model weights, optimizer state, torch files.

The caller verifies the files it reads first (find.py, ``verify_checkpoint``). Every failure to
read is one UserError line naming the checkpoint and the file; nothing pickled is ever executed.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from safetensors.torch import _remove_duplicate_names
from torch.distributed.tensor import DTensor

from zfctl.errors import UserError
from zfctl.train.checkpoint.format import MODEL_FILE, CheckpointInfo
from zfctl.train.checkpoint.shards import is_sharded, load_weights
from zfctl.train.tensorfile import load_state, tensors_of


def load_model_weights(info: CheckpointInfo, model: torch.nn.Module) -> None:
    """Copy the checkpoint's weights into ``model`` (same architecture; strict), one tensor at a
    time straight into the parameters: no second copy of the model in memory.

    Either layout (``model.safetensors``, or the FSDP2 shard files of any number of ranks) into
    either kind of model (plain, or FSDP2-sharded over any number of ranks, where each rank reads
    the rows it holds only): shards.py. A plain file into a plain model reads each tensor straight
    into its parameter (tensorfile.py ``FileTensor.copy_to``).
    """
    if is_sharded(info) or any(isinstance(t, DTensor) for t in model.state_dict().values()):
        load_weights(info, model)
        return
    path = info.path / MODEL_FILE
    try:
        stored = tensors_of(path)
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint {info.path} is unreadable: {MODEL_FILE}: {e}") from None
    state = model.state_dict()
    # Tied weights are stored once, under one of their names: any name of a tie group will do.
    groups = {name: [name, *others] for name, others in _remove_duplicate_names(dict(state)).items()}
    alias = {n: group for group in groups.values() for n in group}
    missing = [n for n in state if not any(a in stored for a in alias.get(n, [n]))]
    unexpected = [n for n in stored if n not in state]
    if missing or unexpected:
        raise UserError(f"checkpoint {info.path} does not match the model: missing "
                        f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    try:
        with torch.no_grad():
            for name, t in stored.items():
                if tuple(state[name].shape) != t.shape:
                    raise ValueError(f"{name} has shape {list(t.shape)}, the model {list(state[name].shape)}")
                t.copy_to(state[name])
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"checkpoint {info.path} is unreadable: {MODEL_FILE}: {e}") from None


def load_optimizer(info: CheckpointInfo, name: str, *, lazy: bool = True) -> Any:
    """An optimizer state file of ``info``: its large tensors as file ranges the optimizer reads
    straight into its buffers (tensorfile.py); a legacy ``.pt`` memory-mapped by torch.load.
    ``lazy=False``: every tensor read into memory (a state re-cut across strategies slices it)."""
    if name.endswith(".pt"):
        return load_torch(info, name, mmap=True)
    path = info.path / name
    if not path.is_file():
        raise UserError(f"checkpoint {info.path} has no {name}")
    try:
        return load_state(path, lazy=lazy)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"checkpoint {info.path} is unreadable: {name}: {e}; pick another checkpoint") from None


def load_torch(info: CheckpointInfo, name: str, *, mmap: bool = False) -> Any:
    """Load one of the checkpoint's torch files onto the CPU (``mmap``: tensors map the file
    instead of being read into new memory)."""
    try:
        # weights_only: a checkpoint is tensors, numbers and strings; refusing arbitrary pickled
        # objects means loading a checkpoint someone sent you cannot run their code.
        return torch.load(info.path / name, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise UserError(f"checkpoint {info.path} has no {name}") from None
    except pickle.UnpicklingError:
        # torch's own text here advises weights_only=False, i.e. running whatever code the file
        # holds: the wrong advice for a file that is damaged or not a zfctl checkpoint.
        raise UserError(f"checkpoint {info.path} is unreadable: {name} holds objects other than tensors "
                        "and numbers (damaged, or not written by zfctl); pick another checkpoint") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {info.path} is unreadable: {name}: {first}; pick another checkpoint") from None
