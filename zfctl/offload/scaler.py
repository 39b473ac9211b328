"""Dynamic loss scaling for fp16 models, owned by the optimizer.

The scale lives on the host as a Python float: ``scale_loss`` multiplies by it without touching the
device, and the unscale is folded into the single gradient coefficient (together with the clip
factor) that both the device and the CPU path apply. Constants follow ``torch.amp.GradScaler``.
"""

from __future__ import annotations


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
