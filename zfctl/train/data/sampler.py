"""A deterministic, resumable stream of micro-batch indices.

Each epoch visits the training set in a fresh permutation drawn from ``(seed, epoch)`` alone, so
the order never depends on what ran before. The position is ``(epoch, offset)`` where ``offset``
counts *samples* of the epoch's permutation already handed out across all ranks. Restoring a
position regenerates one permutation and slices it: O(1) in the number of batches already seen,
with no replay of the data pipeline. Because the offset is in samples, not batches, the position
also stays meaningful when a run is resumed with a different world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplerPosition:
    """Where the stream stands: the next micro-batch starts at ``offset`` in epoch ``epoch``."""

    epoch: int = 0
    offset: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    @classmethod
    def from_dict(cls, d: dict) -> SamplerPosition:
        return cls(epoch=int(d["epoch"]), offset=int(d["offset"]))


class ResumableSampler:
    """Yields, per micro-step, this rank's slice of a global micro-batch.

    A global micro-batch is ``micro_batch_size * world_size`` consecutive entries of the epoch's
    permutation; rank ``r`` takes the ``r``-th block of ``micro_batch_size``. With one process the
    last, shorter batch of an epoch is kept (no sample is dropped). With several processes an
    incomplete last global batch is dropped, so that every rank always has the same batch shape
    and DP-averaging weighs ranks equally; at most ``world_size * micro_batch_size - 1`` samples
    per epoch are skipped.
    """

    def __init__(self, num_samples: int, micro_batch_size: int, *, seed: int, rank: int = 0,
                 world_size: int = 1, position: SamplerPosition | None = None) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.global_batch = micro_batch_size * world_size
        if self.batches_per_epoch() == 0:
            raise ValueError(
                f"{num_samples} training samples cannot fill one global micro-batch of "
                f"{self.global_batch} ({micro_batch_size} per process x {world_size} processes)"
            )
        self._position = position or SamplerPosition()
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor | None = None

    def batches_per_epoch(self) -> int:
        """Micro-steps (global micro-batches) in one epoch."""
        if self.world_size == 1:
            return -(-self.num_samples // self.global_batch)
        return self.num_samples // self.global_batch

    @property
    def position(self) -> SamplerPosition:
        """The position of the *next* batch (what a checkpoint stores)."""
        return self._position

    def _permutation(self, epoch: int) -> torch.Tensor:
        # A private generator keeps the global torch RNG (dropout, init) untouched, so the data
        # order and the model's randomness never perturb each other.
        if self._perm_epoch != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_samples, generator=g)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def next_indices(self) -> list[int]:
        """This rank's sample indices for the next micro-step, and advance the position."""
        epoch, offset = self._position.epoch, self._position.offset
        usable = self.batches_per_epoch() * self.global_batch if self.world_size > 1 else self.num_samples
        if offset >= usable:
            epoch, offset = epoch + 1, 0
        perm = self._permutation(epoch)
        end = min(offset + self.global_batch, usable)
        # Split the (possibly short, world_size == 1 only) global batch between ranks.
        lo = offset + self.rank * self.micro_batch_size
        hi = min(lo + self.micro_batch_size, end)
        self._position = SamplerPosition(epoch, end)
        return perm[lo:hi].tolist()
