"""What the benchmark trains: the reference's synthetic MLP, or a preset architecture.

Both are built with a fixed seed, so every configuration of a grid starts from the same weights
and sees the same inputs. All inputs are generated before timing starts and already live on the
device, so the timed loop contains no host-side data work and no H2D copy of a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zfctl.errors import UserError

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Batch = dict[str, torch.Tensor]


@dataclass
class BenchModel:
    """A model plus the pre-generated inputs of every step and the loss that drives it."""

    module: nn.Module
    batches: list[Batch]
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor]
    description: str
    samples_per_step: int
    tokens_per_step: int

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @property
    def param_bytes(self) -> int:
        """Bytes of the model's own weights (in the model dtype): the unit of 'traffic x model'."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape, for the report and for checking transfer volumes."""
        return {n: tuple(p.shape) for n, p in self.module.named_parameters()}


def _mlp_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    # Logits are cast to fp32 for the cross-entropy: hidden_dim values, negligible cost, and the
    # loss of a bf16/fp16 softmax would be noisier than the reference needs for timing only.
    logits = module(batch["x"]).float()
    return nn.functional.cross_entropy(logits, batch["y"])


def synthetic_model(
    *, hidden_dim: int, nlayers: int, dtype: str, device: torch.device, seed: int, steps: int
) -> BenchModel:
    """The reference benchmark's model: `nlayers` x Linear(hidden, hidden) with bias.

    One sample per step: x ~ N(0, 1) of shape [1, hidden], label uniform in [0, hidden).
    """
    torch.manual_seed(seed)
    dt = DTYPES[dtype]
    layers = [nn.Linear(hidden_dim, hidden_dim, bias=True, device=device, dtype=dt) for _ in range(nlayers)]
    module = nn.Sequential(*layers)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    # Generated on the host with a CPU generator (identical on every device), moved once.
    xs = torch.randn(steps, 1, hidden_dim, generator=gen).to(device=device, dtype=dt)
    ys = torch.randint(0, hidden_dim, (steps, 1), generator=gen).to(device)
    batches = [{"x": xs[i], "y": ys[i]} for i in range(steps)]
    desc = f"{nlayers} x Linear({hidden_dim}, {hidden_dim}) + bias, {dtype}, 1 sample/step"
    return BenchModel(module, batches, _mlp_loss, desc, samples_per_step=1, tokens_per_step=1)


def _lm_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    # labels == input_ids: Hugging Face causal LMs shift them internally.
    return module(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def preset_model(
    model_cfg: Any,
    *,
    dtype: str,
    device: torch.device,
    seed: int,
    steps: int,
    seq_len: int,
    batch: int,
) -> BenchModel:
    """A preset architecture with random weights, fed uniformly random token ids.

    `model_cfg` is a `zfctl.plan.schema.ModelConfig` whose source is 'config' (the caller turns
    hub presets into their architecture config: a benchmark needs shapes, not weights).
    """
    try:
        from zfctl.train.model import load_model
    except ImportError as exc:  # the training layer is built by another part of the project
        raise UserError(f"--model needs zfctl.train.model, which is not available: {exc}") from exc
    module = load_model(model_cfg, precision=dtype, device=device, seed=seed)
    vocab = int(module.config.vocab_size)
    max_pos = getattr(module.config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > int(max_pos):
        raise UserError(f"--seq-len {seq_len}: the model {model_cfg.name} takes at most {max_pos} tokens")
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (steps, batch, seq_len), generator=gen).to(device)
    batches = [{"input_ids": ids[i]} for i in range(steps)]
    desc = f"{model_cfg.name} (random init), {dtype}, batch {batch} x seq {seq_len}"
    return BenchModel(module, batches, _lm_loss, desc, samples_per_step=batch, tokens_per_step=batch * seq_len)
