"""What the benchmark trains: the reference's synthetic MLP, or a preset architecture.

Both are built with a fixed seed, so every configuration of a grid starts from the same weights
and sees the same inputs. All inputs are generated before timing starts and already live on the
device, so the timed loop contains no host-side data work and no H2D copy of a batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
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


def _mlp_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    # Logits are cast to fp32 for the cross-entropy: hidden_dim values, negligible cost, and the
    # loss of a bf16/fp16 softmax would be noisier than the reference needs for timing only.
    logits = module(batch["x"]).float()
    return nn.functional.cross_entropy(logits, batch["y"])


def synthetic_model(
    steps: int, *, hidden_dim: int, nlayers: int, dtype: str, device: torch.device, seed: int
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
    # labels == input_ids: Hugging Face causal LMs shift them internally. use_cache=False: a training
    # step has no use for the KV cache, and under activation checkpointing transformers warns that it
    # turns the cache off (as zfctl/train/loss.py does for finetune).
    return module(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss


# Keys of a preset's `model.arch` summary that are LlamaConfig fields of the same meaning.
ARCH_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "intermediate_size",
    "tie_word_embeddings",
)


def arch_model_config(model_cfg: Any, *, seq_len: int) -> Any:
    """A `source: config` copy of a preset's ModelConfig, for a random-init benchmark model.

    A benchmark needs shapes, not weights. `source: config` presets are used as they are; hub
    presets carry an `arch` summary, which becomes a Llama-shaped config of those sizes (exact
    for Llama presets; for other families a Llama of the same width, depth and vocabulary).
    """
    if model_cfg.source == "config" and model_cfg.config:
        return model_cfg
    arch = dict(model_cfg.arch or {})
    missing = [
        k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in arch
    ]
    if missing:
        raise UserError(
            f"--model {model_cfg.name}: the preset gives no architecture (model.config or "
            f"model.arch with {', '.join(missing)}), so it cannot be built with random weights"
        )
    config = {"model_type": "llama", **{k: arch[k] for k in ARCH_KEYS if k in arch}}
    config.setdefault("intermediate_size", 4 * int(arch["hidden_size"]))
    config["max_position_embeddings"] = max(seq_len, 2048)
    return replace(model_cfg, source="config", config=config, hub_id=None)


def recomputing(build: Callable[[int], BenchModel]) -> Callable[[int], BenchModel]:
    """``build`` with activation checkpointing on its model (zfctl/train/models/load.py, the
    switch a run uses): every decoder layer runs its forward again in the backward."""
    from zfctl.train.models.load import enable_activation_checkpointing

    def build_recomputing(steps: int) -> BenchModel:
        model = build(steps)
        enable_activation_checkpointing(model.module)
        model.description += ", activation checkpointing"
        return model

    return build_recomputing


class PresetFactory:
    """A preset architecture with random weights, fed uniformly random token ids.

    The model is initialised once, on the host, in the benchmark dtype (for a 1B model that is
    2.5 GB of host RAM kept for the whole run); each trial deep-copies it and moves the copy to
    the device (one H2D copy of the weights), instead of re-running a multi-second random init.
    """

    def __init__(
        self, model_cfg: Any, *, dtype: str, device: torch.device, seed: int, seq_len: int, batch: int
    ) -> None:
        from transformers import PretrainedConfig

        from zfctl.train.models.load import load_model  # the training layer owns model construction

        cfg = arch_model_config(model_cfg, seq_len=seq_len)
        self.template = load_model(cfg, precision=dtype, device=torch.device("cpu"), seed=seed)
        self.template.requires_grad_(True)
        max_pos = getattr(self.template.config, "max_position_embeddings", None)
        if max_pos is not None and seq_len > int(max_pos):
            raise UserError(f"--seq-len {seq_len}: the model {model_cfg.name} takes at most {max_pos} tokens")
        hf_config = self.template.config
        assert isinstance(hf_config, PretrainedConfig), "load_model builds a transformers model"
        self.vocab = int(hf_config.vocab_size)
        self.device, self.seed, self.seq_len, self.batch = device, seed, seq_len, batch
        how = "" if model_cfg.source == "config" else ", Llama-shaped from the preset's arch"
        self.description = (f"{model_cfg.name} (random init{how}, uniformly random token ids), {dtype}, "
                            f"batch {batch} x seq {seq_len}")

    def __call__(self, steps: int) -> BenchModel:
        module = copy.deepcopy(self.template).to(self.device)
        gen = torch.Generator(device="cpu").manual_seed(self.seed + 1)
        ids = torch.randint(0, self.vocab, (steps, self.batch, self.seq_len), generator=gen).to(self.device)
        batches = [{"input_ids": ids[i]} for i in range(steps)]
        return BenchModel(
            module,
            batches,
            _lm_loss,
            self.description,
            samples_per_step=self.batch,
            tokens_per_step=self.batch * self.seq_len,
        )
