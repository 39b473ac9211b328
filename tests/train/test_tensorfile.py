"""The streamed checkpoint state file (zfctl/train/tensorfile.py): what is written reads back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from zfctl.train.checksum import file_digest
from zfctl.train.tensorfile import SMALL_BYTES, FileTensor, load_state, save_state_hashed


def _state() -> dict:
    big = torch.randn(SMALL_BYTES // 4 + 1008, generator=torch.Generator().manual_seed(0))  # read lazily
    return {"format": "x", "betas": (0.9, 0.999), "steps": [1, 2.5, None, True],
            "host": [{"name": "w", "master": big[:SMALL_BYTES // 4 + 8].view(-1, 8), "acc": torch.cat([big, big]).to(torch.bfloat16)}],
            "mask": torch.tensor([True, False]), "ids": torch.arange(5), "big": big}


def test_round_trip_values_types_and_digest(tmp_path: Path) -> None:
    st, path = _state(), tmp_path / "s.safetensors"
    digest = save_state_hashed(st, path)
    assert digest == file_digest(path)  # hashed as written
    got = load_state(path)
    assert got["betas"] == (0.9, 0.999) and got["steps"] == [1, 2.5, None, True] and got["format"] == "x"
    assert torch.equal(got["mask"], st["mask"]) and torch.equal(got["ids"], st["ids"])  # small: read now
    big = got["big"]
    assert isinstance(big, FileTensor) and big.shape == tuple(st["big"].shape)
    into = torch.empty_like(st["big"])
    big.copy_to(into)  # straight into a buffer of the caller's
    assert torch.equal(into, st["big"])
    rows = got["host"][0]["master"]
    part = torch.empty(30, 8)
    rows[40:70].copy_to(part)  # a range of rows only
    assert torch.equal(part, st["host"][0]["master"][40:70])
    acc = torch.empty(2 * st["big"].numel(), dtype=torch.float32)
    got["host"][0]["acc"].copy_to(acc)  # another dtype: through a chunk, converted
    assert torch.equal(acc, st["host"][0]["acc"].float())
    with safe_open(str(path), framework="pt") as f:  # a plain safetensors file
        assert len(list(f.keys())) == 5  # master, acc, mask, ids, big


def test_a_truncated_file_is_an_error_not_garbage(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    save_state_hashed(_state(), path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    big = load_state(path)["big"]
    with pytest.raises(OSError, match="ends early"):
        big.copy_to(torch.empty(big.shape))


def test_objects_that_are_not_data_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cannot store"):
        save_state_hashed({"f": object()}, tmp_path / "s.safetensors")



def _strided(shape: tuple[int, ...]) -> torch.Tensor:
    """A non-contiguous tensor of ``shape`` with distinct values."""
    n = torch.Size(shape).numel()
    if len(shape) == 1:
        return torch.arange(2 * n, dtype=torch.float32)[::2]
    return torch.arange(2 * n, dtype=torch.float32).reshape(*shape[:-1], 2 * shape[-1])[..., ::2]


@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 6), (40,)])
def test_a_strided_tensor_is_written_in_row_blocks_through_a_small_chunk(tmp_path: Path, monkeypatch, shape) -> None:
    """write_tensor of a non-contiguous tensor: the bytes of its contiguous copy, written through
    the chunk (48 B here: blocks of 2 rows of (7, 5) with a partial last one, rows of (3, 4, 6)
    larger than the chunk, 12-element blocks of (40,)); copy_to refuses a strided destination."""
    from zfctl.train import checksum

    monkeypatch.setattr(checksum, "CHUNK_BYTES", 48)
    t = _strided(shape)
    assert not t.is_contiguous()
    path = tmp_path / "t.bin"
    with open(path, "wb") as f:
        checksum.write_tensor(f, t)
    assert path.read_bytes() == t.contiguous().numpy().tobytes()
    back = torch.empty(shape, dtype=torch.float32)
    FileTensor(path, 0, torch.float32, shape).copy_to(back)
    assert torch.equal(back, t)
    with pytest.raises(ValueError, match="must be contiguous"):
        FileTensor(path, 0, torch.float32, shape).copy_to(_strided(shape))
