"""Shared pieces for the ZenFlow optimizer tests: a tiny model, a fixed data stream, a train loop.

The model has every kind of parameter the optimizer distinguishes: matrices of different column
lengths (two share one, so device blocks are shared), 1-D biases and a LayerNorm (dense), and it
is small enough that 100 steps take well under a second on one core.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from zfctl.offload.config import TuningConfig, ZenFlowConfig

IN, HID, OUT = 16, 48, 8

# The paper's settings: ZenFlowConfig()'s defaults before the defaults became the `default`
# preset's (select once per epoch, no warm-up, uncorrected CPU step, vocabulary by columns). The
# engine tests build their configs on them, so each keeps testing exactly what it always tested.
PAPER: dict[str, Any] = {"select_interval": "auto", "full_warm_up_rounds": 0, "deferred_lr_scale": "off",
                         "vocab_select": "columns"}
TUNING_KEYS = {f.name for f in fields(TuningConfig)}


def zen(**kw: Any) -> ZenFlowConfig:
    """``ZenFlowConfig`` on the paper's settings with ``kw`` over them; the tuning keys
    (install_lag, ring_slots, release_grads, ...) may be given flat, as the tests always did."""
    tuning = {k: kw.pop(k) for k in list(kw) if k in TUNING_KEYS}
    return ZenFlowConfig(**{**PAPER, **kw}, tuning=TuningConfig(**tuning))


class TinyNet(nn.Module):
    """Linear(16->48) - LayerNorm - GELU - Linear(48->48) - GELU - Linear(48->8)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.norm = nn.LayerNorm(HID)
        self.fc2 = nn.Linear(HID, HID)
        self.head = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.norm(self.fc1(x)))
        return self.head(nn.functional.gelu(self.fc2(h)))


def tiny_net(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet().to(dtype=dtype, device=device)


def batches(steps: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed regression stream; inputs have a few loud channels so column importance is skewed."""
    g = torch.Generator().manual_seed(seed)
    loud = torch.ones(IN)
    loud[[3, 11]] = 8.0
    return [((torch.randn(8, IN, generator=g) * loud).to(dtype), torch.randn(8, OUT, generator=g).to(dtype))
            for _ in range(steps)]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, seed: int = 1, clip: float | None = None,
          after_step: Callable[[int], None] | None = None, scheduler=None) -> list:
    """Plain loop; ``clip`` clips with torch (for the torch.optim.AdamW reference only)."""
    p0 = next(model.parameters())
    out = []
    for i, (x, y) in enumerate(batches(steps, seed, p0.dtype)):
        x, y = x.to(p0.device), y.to(p0.device)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x).float(), y.float())
        loss = opt.scale_loss(loss) if hasattr(opt, "scale_loss") else loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        out.append(opt.step())
        if scheduler is not None:
            scheduler.step()
        if after_step is not None:
            after_step(i)
    return out


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-parameter ||a - b||_inf / ||b||_inf."""
    return max(((a[n].float() - b[n].float()).abs().max() / b[n].float().abs().max()).item() for n in b)


def test_batches_are_a_fixed_stream() -> None:
    a, b = batches(3, seed=5), batches(3, seed=5)
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert not torch.equal(a[0][0], batches(1, seed=6)[0][0])
