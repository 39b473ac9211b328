"""The micro-batch's way to the device (zfctl/train/loss.py ``to_device``): on CUDA page-locked,
then an asynchronous copy, so the host does not wait for the device before each micro-batch
(docs/design.md, section "Transfer scheduling"). No GPU here: the two tensor calls are recorded instead of run;
tests/gpu/test_sync_points.py checks on a GPU that the copy makes no sync."""

from __future__ import annotations

import torch

from zfctl.train.loss import to_device


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 100, (2, 8), generator=g),
            "labels": torch.randint(0, 100, (2, 8), generator=g),
            "attention_mask": torch.ones(2, 8, dtype=torch.long)}


def test_a_cuda_batch_is_page_locked_then_copied_non_blocking(monkeypatch) -> None:
    pinned: set[int] = set()
    copies: list[tuple[bool, str, bool]] = []  # (from a page-locked copy, device, non_blocking)

    def pin_memory(self: torch.Tensor) -> torch.Tensor:
        out = self.clone()  # stands for the page-locked copy
        pinned.add(id(out))
        return out

    def to(self: torch.Tensor, device, non_blocking: bool = False, **_) -> torch.Tensor:
        copies.append((id(self) in pinned, str(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    batch = _batch()
    out = to_device(batch, torch.device("cuda"))
    assert copies == [(True, "cuda", True)] * len(batch)
    assert all(torch.equal(out[k], batch[k]) for k in batch)


def test_a_cpu_batch_is_neither_pinned_nor_copied() -> None:
    batch = _batch()
    out = to_device(batch, torch.device("cpu"))
    assert all(out[k] is batch[k] for k in batch)
