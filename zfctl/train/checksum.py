"""Checkpoint files written through a hash: each file's digest is known the moment it is closed.

``meta.json`` records an xxh3-128 digest per file (xxhash: ~10x the speed of blake2b, so hashing
while writing costs a few percent of a save, not a second pass over the bytes). Resume and export
re-hash the files they read before they load anything: same-size corruption (a flipped sector, a garbled
tensor) is caught there instead of training on NaN.

Three writers feed the hash as the bytes go out:

* ``torch.save`` into a :class:`HashingWriter`: torch streams the zip archive through ``write``.
* :func:`save_model_hashed`, a streaming safetensors writer. ``safetensors.torch.save_model``
  only writes to a path (no second read allowed means no hashing afterwards), and
  ``safetensors.torch.save`` builds the whole file in memory (one more copy of the model in host
  RAM). Here each tensor is checked for non-finite values on its own device, then hashed and
  written through :func:`write_tensor`; the file is byte-for-byte the format
  ``safetensors.torch.load_model`` reads.
* ``tensorfile.save_state_hashed``, the optimizer state, through :func:`write_tensor` too.

Resume and export re-hash every file they load before loading it.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
import xxhash
from safetensors.torch import _TYPES, _remove_duplicate_names

from zfctl.offload.sizing import CHUNK_BYTES

HASH_NAME = "xxh3_128"
_CHUNK = 8 << 20  # verification reads 8 MiB at a time: large enough to stream, small in RAM
# Device tensors reach a checkpoint through one host chunk of CHUNK_BYTES at a time (the plan's
# "checkpoint I/O" line, zfctl/plan/memory.py, reads it from sizing.py without torch).
_DTYPE_NAMES = {dtype: name for name, dtype in _TYPES.items()}


class NonFiniteTensorError(ValueError):
    """A model tensor holds NaN or inf: the state is not worth a checkpoint."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"tensor {name} holds NaN or inf values")


class HashingWriter:
    """A write-only file object that hashes every byte on its way to ``f``.

    torch's zip writer calls ``write`` from C++ and turns a Python exception raised there into its
    own ``RuntimeError`` ("unexpected pos ..."); the first ``OSError`` is therefore kept in
    ``error`` so the caller can report the real cause (ENOSPC, EIO) instead.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._hash = xxhash.xxh3_128()
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        self._hash.update(data)
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def write_hashed(path: Path, fill: Callable[[HashingWriter], None]) -> str:
    """Create ``path``, let ``fill`` write it through a :class:`HashingWriter`, fsync; the digest."""
    with open(path, "wb") as f:
        w = HashingWriter(f)
        try:
            fill(w)
            f.flush()
            os.fsync(f.fileno())
        except Exception:
            if w.error is not None:  # the OS said why; torch's wrapper message would not
                raise w.error from None
            raise
    return w.hexdigest()


def save_torch_hashed(obj: Any, path: Path) -> str:
    """``torch.save(obj)`` to ``path``; returns the file's digest."""
    # HashingWriter has the write/flush that torch.save uses; typed as the file object it stands for
    return write_hashed(path, lambda w: torch.save(obj, cast(BinaryIO, w)))


def save_model_hashed(model: torch.nn.Module, path: Path, metadata: dict[str, str]) -> str:
    """``model``'s state_dict as safetensors (tied tensors once, like ``save_model``); the digest.

    Raises :class:`NonFiniteTensorError` (before the file is complete) if a floating-point tensor
    holds NaN/inf: a checkpoint of such weights would only spread the damage.
    """
    state = model.state_dict()
    for dropped in _remove_duplicate_names(state).values():  # tied weights: keep one name
        for name in dropped:
            del state[name]
    return save_tensors_hashed(list(state.items()), path, metadata)


def save_tensors_hashed(tensors: list[tuple[str, torch.Tensor]], path: Path, metadata: dict[str, str]) -> str:
    """``tensors`` as one safetensors file, each checked finite, hashed and written in turn (no
    copy of them in memory); the digest. Raises :class:`NonFiniteTensorError` like
    :func:`save_model_hashed`."""
    head = safetensors_header(tensors, metadata)

    def fill(w: HashingWriter) -> None:
        w.write(head)
        for name, t in tensors:
            t = t.detach()
            if t.is_floating_point() and not _all_finite(t):  # on the tensor's own device
                raise NonFiniteTensorError(name)
            write_tensor(w, t)  # a host tensor from its memory, a device one chunk by chunk

    return write_hashed(path, fill)


def safetensors_header(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """The safetensors header of ``tensors`` written one after another: its 8-byte length, then
    the JSON of names, dtypes, shapes and byte ranges, padded so that tensor data starts 8-aligned."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:  # torch tensors, or ones formed as they are written (``write_tensor``)
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_tensor(w: HashingWriter | BinaryIO, t: Any) -> None:
    """Write ``t``'s bytes in row-major order: from its memory for a contiguous host tensor, else
    through one reused ``CHUNK_BYTES`` host buffer (a device tensor: one synchronous D2H per chunk;
    a strided tensor: whole leading-dimension blocks, so no full contiguous copy is ever made; a
    tensor formed as it is read, zfctl/offload/cpu/partial.py ``PartialSum``: its own chunks)."""
    if t.numel() == 0:
        return
    if not isinstance(t, torch.Tensor):
        for part in t.chunks(CHUNK_BYTES):
            w.write(part.reshape(-1).view(torch.uint8).numpy().data)
        return
    if t.device.type == "cpu" and t.is_contiguous():
        flat = t.reshape(-1).view(torch.uint8)
        for a in range(0, flat.numel(), CHUNK_BYTES):
            w.write(flat[a : a + CHUNK_BYTES].numpy().data)
        return
    # Contiguous: element ranges of the flat view; strided: blocks of whole rows of dim 0 (a row
    # larger than the chunk is one block, its own size).
    t = t.reshape(-1) if t.is_contiguous() else t
    per = max(1, CHUNK_BYTES // (t[0].numel() * t.element_size()))
    staging = torch.empty((min(per, t.shape[0]), *t.shape[1:]), dtype=t.dtype)
    for a in range(0, t.shape[0], per):
        part = staging[: min(per, t.shape[0] - a)]
        part.copy_(t[a : a + part.shape[0]])  # CUDA: one pageable D2H copy, at checkpoint time only
        w.write(part.reshape(-1).view(torch.uint8).numpy().data)


def _all_finite(t: torch.Tensor) -> bool:
    """True iff ``t`` has no NaN/inf. The sum is ~20x faster than ``isfinite(t).all()`` on CPU and
    is finite whenever every element is, unless it overflows; only then is every element tested."""
    return bool(t.sum().isfinite()) or bool(torch.isfinite(t).all())


def file_digest(path: Path) -> str:
    """The digest of a file on disk (verification: one sequential read)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
