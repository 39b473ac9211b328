"""Checkpoint state streamed to and from disk without a second copy of it in memory.

At 7B the optimizer state is ~116 GB (16 B per offloaded element on the host, the selected
columns on the device). ``torch.save`` of CPU copies of it, and ``torch.load`` of it into fresh
buffers, each needed as much memory again for a moment (docs/design.md, "Checkpoint format").
Here:

* **Saving** writes the state's live tensors as they are (the optimizer's ``state_dict`` returns
  its buffers, not copies, after the pipeline settled): a host tensor's bytes go to the file
  straight from its memory, a device tensor's through one staging chunk of ``CHUNK_BYTES`` at a
  time, and a tensor that exists nowhere as a buffer (the unfinished interval's gradient sum,
  ``checkpoint_state``: zfctl/offload/cpu/partial.py) is formed one chunk at a time as it is
  written. Extra memory: one chunk.
* **Resuming** reads the file's header only, and gives every large tensor as a :class:`FileTensor`
  (a range of the file); ``FileTensor.copy_to(dst)`` reads it straight into the engine's own
  buffer (``readinto``: the page cache, not a mapping, so it never counts twice in the process's
  RSS), or through one staging chunk for a device buffer. Extra memory: one chunk.

The file is the safetensors format (an 8-byte header length, a JSON header of tensor names,
dtypes, shapes and byte ranges, then the raw bytes), readable by ``safetensors.safe_open``. The
non-tensor parts of the state (counters, config, names, nested dicts and lists) are kept in the
header's ``__metadata__`` as one JSON document in which each tensor is ``{"__tensor__": name}``
(a tuple is ``{"__tuple__": [...]}``), so nothing is pickled: a checkpoint cannot run code.
Every byte is hashed as it is written (checksum.py), like every other checkpoint file.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import _TYPES

from zfctl.train.checksum import CHUNK_BYTES, HashingWriter, safetensors_header, write_hashed, write_tensor

SMALL_BYTES = 1 * 2**20  # tensors up to this size are read at once; larger ones stay FileTensors
META_KEY = "zfctl.state"


def save_state_hashed(state: Any, path: Path) -> str:
    """Write ``state`` (nested dicts/lists/tuples of tensors on any device, numbers, strings,
    None) to ``path``; returns the file's digest. Tensors are streamed (module docstring)."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def encode(x: Any) -> Any:
        if isinstance(x, torch.Tensor) or hasattr(x, "chunks"):  # a tensor, or one formed as it is read
            name = f"t{len(tensors)}"
            tensors.append((name, x))
            return {"__tensor__": name}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError(f"state dict keys must be strings, got {sorted(map(type, x), key=str)}")
            return {k: encode(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return {"__tuple__": [encode(v) for v in x]}
        if isinstance(x, list):
            return [encode(v) for v in x]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot store a {type(x).__name__} in a checkpoint state")

    skeleton = json.dumps(encode(state))  # fills ``tensors``
    head = safetensors_header(tensors, {META_KEY: skeleton})

    def fill(w: HashingWriter) -> None:
        w.write(head)
        for _, t in tensors:
            write_tensor(w, t)

    return write_hashed(path, fill)


class FileTensor:
    """Rows ``[0, shape[0])`` of a tensor stored at ``offset`` of ``path``, not read yet.

    Supports what a loader needs: ``shape``, ``dtype``, ``numel()``, slicing along the first
    dimension, ``reshape(-1)``, ``copy_to(dst)`` and ``load()`` (a new tensor).
    """

    def __init__(self, path: Path, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.path, self.offset, self.dtype, self.shape = Path(path), offset, dtype, tuple(shape)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def __getitem__(self, rows: slice) -> FileTensor:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("FileTensor slices take contiguous rows only")
        row = self.nbytes // self.shape[0] if self.shape[0] else 0
        return FileTensor(self.path, self.offset + start * row, self.dtype, (max(0, stop - start), *self.shape[1:]))

    def reshape(self, *shape: int) -> FileTensor:
        if tuple(shape) not in ((-1,), (self.numel(),)):
            raise ValueError(f"FileTensor reshapes to (-1,) only, got {shape}")
        return FileTensor(self.path, self.offset, self.dtype, (self.numel(),))

    def copy_to(self, dst: torch.Tensor) -> None:
        """Read the bytes into ``dst`` (same number of elements): straight into a contiguous host
        tensor of the same dtype, else through one chunk at a time (a device tensor: one H2D per
        chunk, synchronous, at resume only)."""
        if dst.numel() != self.numel():
            raise ValueError(f"{self.path.name}: a tensor of {self.numel()} elements cannot fill {dst.numel()}")
        if self.numel() == 0:
            return
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset)
            if dst.device.type == "cpu" and dst.is_contiguous() and dst.dtype == self.dtype:
                _read_exactly(f, dst.reshape(-1).view(torch.uint8), self.path)
                return
            if not dst.is_contiguous():  # every caller fills a live buffer or a slice of one
                raise ValueError(f"{self.path.name}: the destination must be contiguous")
            flat = dst.reshape(-1)
            per = max(1, CHUNK_BYTES // self.dtype.itemsize)
            staging = torch.empty(min(per, self.numel()), dtype=self.dtype)
            for a in range(0, self.numel(), per):
                part = staging[: min(per, self.numel() - a)]
                _read_exactly(f, part.view(torch.uint8), self.path)
                flat[a : a + part.numel()].copy_(part)

    def load(self) -> torch.Tensor:
        """A new host tensor with the values."""
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_to(out)
        return out


def _read_exactly(f: io.FileIO, buf: torch.Tensor, path: Path) -> None:
    view = buf.numpy().data
    got = 0
    while got < len(view):
        n = f.readinto(view[got : got + CHUNK_BYTES])
        if not n:
            raise OSError(f"{path}: the file ends early (truncated?)")
        got += n


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header of ``path`` and the byte offset where tensor data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path.name}: not a safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"{path.name}: not a safetensors file (a header of {n} bytes)")
        header = json.loads(f.read(n))
    return header, 8 + n


def tensors_of(path: Path) -> dict[str, FileTensor]:
    """Every tensor of a safetensors file, as unread :class:`FileTensor`\\ s."""
    header, data = read_header(path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, _ = info["data_offsets"]
        dtype = _TYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path.name}: tensor {name} has dtype {info['dtype']}, which torch does not know")
        out[name] = FileTensor(path, data + a, dtype, tuple(info["shape"]))
    return out


def load_state(path: Path, *, lazy: bool = True) -> Any:
    """The state :func:`save_state_hashed` wrote: tensors up to ``SMALL_BYTES`` read now, larger
    ones as :class:`FileTensor`\\ s for the loader to ``copy_to`` where they belong (``lazy=False``:
    every tensor read now, e.g. to compare two states)."""
    header, _ = read_header(path)
    meta = header.get("__metadata__") or {}
    if META_KEY not in meta:
        raise ValueError(f"{path.name}: not a zfctl state file (no {META_KEY} in its metadata)")
    tensors = tensors_of(path)

    def decode(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {"__tensor__"}:
                t = tensors[x["__tensor__"]]
                return t.load() if t.nbytes <= SMALL_BYTES or not lazy else t
            if set(x) == {"__tuple__"}:
                return tuple(decode(v) for v in x["__tuple__"])
            return {k: decode(v) for k, v in x.items()}
        if isinstance(x, list):
            return [decode(v) for v in x]
        return x

    return decode(json.loads(meta[META_KEY]))
