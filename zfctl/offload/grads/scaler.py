"""Dynamic loss scaling for fp16 models, and the gradient coefficient it takes part in.

The scale lives on the host as a Python float: ``scale_loss`` multiplies by it without touching the
device. A step's gradient is scaled by two factors (docs/design.md, "Algorithm", step 1): the
unscale ``u = 1 / loss_scale`` (1.0 without fp16), known on the host before the backward, and the
clip factor ``k``, known on the device once the step's norm is. The device-owned columns and the
dense params take their product ``k u`` (the *coefficient*) every step; the host-owned columns'
interval sum takes ``u`` as each step lands and the interval's mean ``k`` at its CPU update (the
interval-mean rule, docs/design.md). Constants follow ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import torch


class DynamicLossScaler:
    """Halve the scale on an overflow; double it after ``growth_interval`` overflow-free steps."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, min_scale: float = 1.0) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        """Record one step's outcome and adjust the scale for the next step."""
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])


def param_norm(g: torch.Tensor) -> torch.Tensor:
    """One gradient's L2 norm as ``coefficient`` takes it (fp32, torch's foreach kernel)."""
    return torch._foreach_norm([g], 2.0, dtype=torch.float32)[0]


class GradientScale:
    """A step's clip factor ``k = min(1, max_norm / (norm + 1e-6))`` (torch.nn.utils.clip_grad_norm_'s
    formula, global L2 norm over every gradient), its unscale ``u`` (1 / the fp16 loss scale, or 1)
    and their product, the coefficient ``k u`` the device half multiplies by. The norm, ``k`` and
    ``k u`` are device tensors (no host sync); ``u`` is a host float."""

    def __init__(self, max_grad_norm: float | None, scaler: DynamicLossScaler | None, device: torch.device) -> None:
        self.max_grad_norm = max_grad_norm
        self.scaler = scaler
        self.device = device

    @property
    def needs_norm(self) -> bool:
        """A step needs the global gradient norm (clipping, or the fp16 overflow check)."""
        return self.max_grad_norm is not None or self.scaler is not None

    @property
    def unscale(self) -> float:
        """``u``: what this step's gradients are multiplied by to undo the fp16 loss scale (a power
        of two: the scaler starts at one and only doubles or halves it), 1.0 without fp16. Known
        before the backward, so the host-owned columns take it as they land."""
        return 1.0 / self.scaler.scale if self.scaler is not None else 1.0

    def coefficient(self, grads: list[torch.Tensor | None], sq: torch.Tensor | None = None,
                    norms: dict[int, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(global grad norm, coefficient ``k u``, clip factor ``k``) as 0-dim fp32 device tensors;
        (None, None, None) if none is needed. ``k`` is 1 without ``max_grad_norm``; the host reads
        it with the step's scalars (cpu/phases.py) for the interval-mean rule: read, not derived
        from ``k u / u``, since ``k u`` is rounded. ``sq``: the global sum of squares, when the
        data-parallel exchange assembled it. ``norms``: per param index, the L2 norm a gradient
        hook took before it freed that ``.grad`` (release.py; ``param_norm``, the same kernel as
        here, so the same bits)."""
        if not self.needs_norm:
            return None, None, None
        norms = norms or {}
        present = {i: g for i, g in enumerate(grads) if g is not None and i not in norms}
        if sq is None and not present and not norms:
            zero = torch.zeros((), device=self.device)
            return zero, zero + 1.0, zero + 1.0
        if sq is not None:
            norm = sq.sqrt()
        else:
            computed = dict(norms)
            if present:
                computed.update(zip(present, torch._foreach_norm(list(present.values()), 2.0, dtype=torch.float32)))
            norm = torch.linalg.vector_norm(torch.stack([computed[i] for i in sorted(computed)]))
        coef = torch.ones((), device=self.device)
        clip = coef
        if self.scaler is not None:
            norm = norm / self.scaler.scale  # the unscaled norm
            coef = coef / self.scaler.scale
        if self.max_grad_norm is not None:
            clip = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            coef = coef * clip
        return norm, coef, clip

    def overflowed(self, norm: torch.Tensor | None) -> bool:
        """fp16 only: True (and the scale halved) when this step's gradients hold inf/NaN: the step
        is skipped. A host sync, the one per-step sync that exists for fp16 alone."""
        if self.scaler is None or norm is None or bool(torch.isfinite(norm).item()):
            return False
        self.scaler.update(overflow=True)
        return True

    def step_done(self) -> None:
        """A step was taken without overflow (the scale may grow)."""
        if self.scaler is not None:
            self.scaler.update(overflow=False)
