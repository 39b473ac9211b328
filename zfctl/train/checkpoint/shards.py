"""Model weights as FSDP2 shards: one file per rank, read back into any layout.

Under ``distributed.strategy: fsdp`` no process holds the whole model, so each rank writes its
own ``model-rankRRRRR.safetensors`` (format.py ``model_shard_file``): its local shard
(``DTensor.to_local()``) of every FSDP2 parameter under the parameter's usual name, and, in rank
0's file only, every tensor of the state_dict that is not a sharded DTensor (buffers). Tied
weights are stored once, as in ``model.safetensors``. Each file's metadata says where it belongs,
so a reader needs nothing but the files::

    {"format": "pt", "step": "120", "shard_rank": "1", "shard_world": "4",
     "shard_dims": "{\\"lm_head.weight\\": 1, \\"model.norm.weight\\": 0, ...}"}

Rank r's piece of a tensor sits after ranks 0..r-1's pieces along its ``shard_dims`` dim (in
zfctl the pieces are equal, zfctl/train/fsdp.py ``check_shardable``; the reader takes each
piece's length from its file, so it does not rely on that).

:func:`load_weights` copies either layout (``model.safetensors`` or W shard files) into either
kind of model (a plain one, or one FSDP2-sharded over any W'): every destination (a plain tensor,
or a rank's local shard) is a box of the full tensor, every stored piece is a box too, and only
their intersections are read (``safe_open(...).get_slice``), one tensor at a time. Extra memory:
the largest piece one tensor contributes to one destination; never a copy of the model.
:func:`full_tensors` yields whole tensors one at a time (export).

docs/design.md, "Checkpoint format", describes the layout for readers outside zfctl.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import _TYPES, _remove_duplicate_names
from torch.distributed.tensor import DTensor, Shard

from zfctl.errors import UserError
from zfctl.train.checkpoint.format import META, MODEL_FILE, CheckpointInfo, model_shard_file
from zfctl.train.checksum import save_tensors_hashed
from zfctl.train.tensorfile import read_header

SHARD_RANK, SHARD_WORLD, SHARD_DIMS = "shard_rank", "shard_world", "shard_dims"  # metadata keys
_SHARD_NAME = re.compile(r"^model-rank(\d{5})\.safetensors$")

Box = tuple[tuple[int, int], ...]  # [start, stop) per dim of the full tensor


# -- writing -------------------------------------------------------------------------------------

def shard_placement(t: DTensor) -> tuple[int, int, int] | None:
    """``(dim, index, count)`` of ``t``'s one ``Shard`` placement: the dim it is cut on, this
    rank's place along that mesh dim and the number of pieces; None when every placement
    replicates. On HSDP's 2-D mesh the replicate dim is skipped: the index is within a replica."""
    shards = [(i, p) for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    if not shards:
        return None
    if len(shards) > 1:
        raise ValueError(f"a tensor sharded over {len(shards)} mesh dims ({tuple(t.placements)}): zfctl shards "
                         "on one (zfctl/train/fsdp.py)")
    i, p = shards[0]
    coord = t.device_mesh.get_coordinate()
    assert coord is not None, "this rank is outside the tensor's mesh"
    return p.dim, coord[i], t.device_mesh.size(i)


def _tied_once(tensors: dict[str, torch.Tensor]) -> set[str]:
    """The names to drop so that each tie group (same storage) is stored once, under the name
    ``safetensors.torch.save_model`` keeps: the same name as the one-process model file."""
    return {n for dropped in _remove_duplicate_names(tensors).values() for n in dropped}


def save_model_shard(model: torch.nn.Module, path: Path, *, step: int, rank: int, world: int) -> str:
    """Write this rank's model file (module docstring) to ``path``; returns its digest.

    ``model`` is FSDP2-sharded (zfctl/train/fsdp.py ``parallelize``); ``rank`` and ``world`` are
    this rank's place among the ``world`` pieces (under HSDP: within its replica, where one
    replica writes). Hashed while written and refused with ``NonFiniteTensorError`` before the
    file is complete when a tensor holds NaN/inf, like ``checksum.save_model_hashed``. Raises
    ValueError when a DTensor is not this rank's piece of ``world``.
    """
    local: dict[str, torch.Tensor] = {}
    dims: dict[str, int] = {}
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            placed = shard_placement(t)
            if placed is not None:
                dim, index, count = placed
                if (index, count) != (rank, world):
                    raise ValueError(f"{name} is piece {index} of {count}, not of rank {rank} of {world}")
                dims[name] = dim
                local[name] = t.to_local()
                continue
            t = t.to_local()  # replicated: every rank holds all of it, rank 0 writes it
        if rank == 0:
            local[name] = t
    drop = _tied_once(local)
    metadata = {"format": "pt", "step": str(step), SHARD_RANK: str(rank), SHARD_WORLD: str(world),
                SHARD_DIMS: json.dumps({n: d for n, d in dims.items() if n not in drop}, sort_keys=True)}
    return save_tensors_hashed([(n, t) for n, t in local.items() if n not in drop], path, metadata)


# -- the stored layout ---------------------------------------------------------------------------

def model_shard_files(info: CheckpointInfo) -> list[str]:
    """The ``model-rankRRRRR.safetensors`` files meta.json lists, in rank order ([] for a
    checkpoint with ``model.safetensors``); UserError when ranks are missing."""
    ranks = sorted(int(m.group(1)) for n in info.meta.get("files", {}) if (m := _SHARD_NAME.match(n)))
    if ranks and ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise UserError(f"checkpoint {info.path} is unreadable: {META} lists model shards of ranks "
                        f"{ranks[0]}..{ranks[-1]} without {model_shard_file(missing[0])}; pick another checkpoint")
    return [model_shard_file(r) for r in ranks]


def is_sharded(info: CheckpointInfo) -> bool:
    """True when ``info`` holds FSDP2 model shards (``model-rank*.safetensors``) instead of
    ``model.safetensors``."""
    return bool(model_shard_files(info))


def model_files_in(info: CheckpointInfo) -> list[str]:
    """The model file(s) of ``info``: what a loader of its weights must verify."""
    return model_shard_files(info) or [MODEL_FILE]


@dataclass
class StoredTensor:
    """One model tensor as stored: its full shape and dtype, and where each piece lies."""

    shape: tuple[int, ...]
    dtype: str
    pieces: list[tuple[str, Box]]  # (file name, the piece's box in the full tensor)
    dim: int | None = None  # the dim it is sharded on; None: whole in one file


@dataclass
class StoredModel:
    """The tensors of a checkpoint's model file(s) (headers only: nothing read yet)."""

    path: Path
    files: list[str]
    tensors: dict[str, StoredTensor]

    def fail(self, name: str, why: object) -> UserError:
        return UserError(f"checkpoint {self.path} is unreadable: {name}: {why}; pick another checkpoint")


def stored_model(info: CheckpointInfo) -> StoredModel:
    """The layout of ``info``'s model, from the headers of its file(s); UserError (naming the
    file) when a header is unreadable or the shard files do not fit together."""
    files = model_files_in(info)
    out = StoredModel(info.path, files, {})
    if files == [MODEL_FILE]:
        for name, t in _header(out, MODEL_FILE)[1].items():
            out.tensors[name] = StoredTensor(tuple(t["shape"]), t["dtype"], [(MODEL_FILE, _whole(t["shape"]))])
        return out
    world, dims = len(files), None
    for rank, file in enumerate(files):
        meta, tensors = _header(out, file)
        try:
            here = json.loads(meta[SHARD_DIMS])
            placed = (int(meta[SHARD_RANK]), int(meta[SHARD_WORLD]))
        except (KeyError, ValueError, TypeError) as e:
            raise out.fail(file, f"no FSDP2 shard metadata ({e})") from None
        if placed != (rank, world):
            raise out.fail(file, f"it holds piece {placed[0]} of {placed[1]}, the checkpoint has {world} model "
                                 f"files and this is rank {rank}'s")
        dims = here if dims is None else dims
        if here != dims:
            raise out.fail(file, f"its {SHARD_DIMS} differ from {files[0]}'s")
        if missing := sorted(set(dims) - set(tensors)):
            raise out.fail(file, f"no piece of {missing[0]}")
        for name, t in tensors.items():
            shape = list(t["shape"])
            if name not in dims:  # not sharded: rank 0's file only
                if rank:
                    raise out.fail(file, f"{name} is not sharded ({SHARD_DIMS}) but is not in rank 0's file only")
                out.tensors[name] = StoredTensor(tuple(shape), t["dtype"], [(file, _whole(shape))])
                continue
            d = int(dims[name])
            if not 0 <= d < len(shape):
                raise out.fail(file, f"{name} is sharded on dim {d} but has shape {shape}")
            prev = out.tensors.get(name)
            start = prev.shape[d] if prev is not None else 0
            if prev is not None and (prev.dtype != t["dtype"] or
                                     [x for i, x in enumerate(prev.shape) if i != d] !=
                                     [x for i, x in enumerate(shape) if i != d]):
                raise out.fail(file, f"its piece of {name} ({t['dtype']} {shape}) does not fit the other ranks' "
                                     f"({prev.dtype} {list(prev.shape)} so far, sharded on dim {d})")
            box = tuple((start, start + x) if i == d else (0, x) for i, x in enumerate(shape))
            full = tuple(start + x if i == d else x for i, x in enumerate(shape))
            if prev is None:
                out.tensors[name] = StoredTensor(full, t["dtype"], [(file, box)], d)
            else:
                prev.shape = full
                prev.pieces.append((file, box))
    return out


def _header(stored: StoredModel, file: str) -> tuple[dict[str, str], dict[str, dict]]:
    try:
        header, _ = read_header(stored.path / file)
    except FileNotFoundError:
        raise UserError(f"checkpoint {stored.path} has no {file}; pick another checkpoint") from None
    except (OSError, ValueError) as e:
        raise stored.fail(file, e) from None
    meta = header.pop("__metadata__", None) or {}
    return meta, header


def _whole(shape: list[int] | tuple[int, ...]) -> Box:
    return tuple((0, x) for x in shape)


def tie_groups(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Every name of a tie group (tensors sharing memory) -> the group's names; tied weights are
    stored once, under one of their names, so any name of the group finds them."""
    groups = [[name, *others] for name, others in _remove_duplicate_names(tensors).items()]
    return {n: group for group in groups for n in group}


def stored_name(stored: StoredModel, name: str, alias: dict[str, list[str]]) -> str:
    """The name ``name``'s tensor is stored under (itself, or another name of its tie group)."""
    for a in alias.get(name, [name]):
        if a in stored.tensors:
            return a
    raise UserError(f"checkpoint {stored.path} does not match the model: no {name} in {', '.join(stored.files)}")


def index(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """``box`` as slices of the full tensor, or of a tensor whose own box is ``origin``."""
    return _index(box, origin if origin is not None else tuple((0, hi) for _, hi in box))


# -- reading -------------------------------------------------------------------------------------

def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _index(box: Box, origin: Box) -> tuple[slice, ...]:
    """``box`` as slices of a tensor whose own box is ``origin``."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def _read(stored: StoredModel, file: str, name: str, box: Box, src: Box) -> torch.Tensor:
    """The values of ``box`` (full-tensor coordinates) from ``file``'s piece of ``name`` (whose
    box is ``src``): only those bytes are read. The file is opened for this one read, so its
    mapping never holds more than what was just read."""
    with safe_open(stored.path / file, framework="pt") as f:
        if box == src:
            return f.get_tensor(name)
        return f.get_slice(name)[_index(box, src)]


def fill(stored: StoredModel, name: str, dst: torch.Tensor, box: Box) -> None:
    """Copy the stored values of ``box`` (full-tensor coordinates) of ``name`` into ``dst``
    (a tensor of that box's shape): each overlapping piece read as one slice, copied, freed."""
    for file, src in stored.tensors[name].pieces:
        part = _intersect(src, box)
        if part is None:
            continue
        try:
            dst[_index(part, box)].copy_(_read(stored, file, name, part, src))
        except (OSError, ValueError, RuntimeError, TypeError) as e:
            raise stored.fail(file, f"{name}: {e}") from None


def destination(t: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """Where a model tensor's values go: the tensor itself and its box (the whole tensor), or a
    sharded DTensor's local shard and the rows it holds (FSDP2 cuts like ``torch.chunk``: every
    piece ``ceil(n / count)`` long but the last ones; in zfctl all equal)."""
    if not isinstance(t, DTensor):
        return t, _whole(t.shape)
    local = t.to_local()
    placed = shard_placement(t)
    if placed is None:
        return local, _whole(t.shape)
    dim, index, count = placed
    size = t.shape[dim]
    start = min(index * -(-size // count), size)
    if local.shape[dim] != min(-(-size // count), size - start):
        raise ValueError(f"a local shard of {local.shape[dim]} rows on dim {dim} is not piece {index} of {count} "
                         f"of {size} rows (torch.chunk)")
    return local, tuple((start, start + local.shape[dim]) if i == dim else (0, x) for i, x in enumerate(t.shape))


def load_weights(info: CheckpointInfo, model: torch.nn.Module) -> None:
    """Copy ``info``'s weights (either layout) into ``model`` (plain, or FSDP2-sharded over any
    number of ranks; same architecture, strict): each rank reads only the rows it holds, one
    tensor at a time. UserError (one line naming the checkpoint and the file) on any mismatch."""
    stored = stored_model(info)
    state = model.state_dict()
    dests = {n: destination(t) for n, t in state.items()}
    alias = tie_groups({n: d[0] for n, d in dests.items()})
    missing = [n for n in state if not any(a in stored.tensors for a in alias.get(n, [n]))]
    unexpected = [n for n in stored.tensors if n not in state]
    if missing or unexpected:
        raise UserError(f"checkpoint {info.path} does not match the model ({', '.join(stored.files[:1])}"
                        f"{' ...' if len(stored.files) > 1 else ''}): missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]}")
    with torch.no_grad():
        for name, t in stored.tensors.items():
            if tuple(state[name].shape) != t.shape:
                raise stored.fail(t.pieces[0][0], f"{name} has shape {list(t.shape)}, the model "
                                                  f"{list(state[name].shape)}")
            dst, box = dests[name]
            fill(stored, name, dst, box)


def full_tensors(info: CheckpointInfo) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``info``'s model, whole, one at a time (tied weights once), from either
    layout; each is a new host tensor that the caller may keep or drop."""
    stored = stored_model(info)
    for name, t in stored.tensors.items():
        dtype = _TYPES.get(t.dtype)
        if dtype is None:
            raise stored.fail(t.pieces[0][0], f"{name} has dtype {t.dtype}, which torch does not know")
        out = torch.empty(t.shape, dtype=dtype)
        fill(stored, name, out, _whole(t.shape))
        yield name, out
