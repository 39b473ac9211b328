"""Learning-rate correction for the deferred (CPU-updated) columns: ``zenflow.deferred_lr_scale``.

A non-selected column gets one AdamW step per interval of ``n`` optimizer steps, taken with the
interval-mean gradient. Adam divides the first moment by the root of the second, so the size of
that one step barely depends on the gradient's scale: about ``lr`` per element, whether the
interval was 1 step or 8. Under plain AdamW the same column would have taken ``n`` steps of about
``lr`` each. The deferred columns therefore move up to ``n`` times less per optimizer step than
the selected ones, and the whole model learns more slowly than AdamW at equal steps.

The correction multiplies the CPU step's learning rate by ``s(n)``:

* ``off``: ``s = 1``, the paper's update (and bit-identical to zfctl before this option);
* ``sqrt``: ``s = sqrt(n)``: the distance ``n`` AdamW steps cover when the per-step gradients are
  mostly noise (a random walk of ``n`` unit steps);
* ``linear``: ``s = n``: the distance ``n`` AdamW steps cover when the per-step gradients all
  point the same way (consistent drift). It overshoots noisy columns.

Only the learning rate changes, never the moments: ``exp_avg``/``exp_avg_sq`` and the per-column
step counter keep meaning "one Adam update absorbed per CPU step", so a column's state stays
valid when it migrates to the device (``selection``) and bias correction is unchanged. Decoupled
weight decay is kept at ``n`` steps' worth, ``n * lr * wd`` to first order, for every mode (the
kernel applies ``lr' * wd'``, so ``wd' = wd * n / s``); with ``off`` that is the paper's
``lr * wd`` per interval, unchanged. Warm-up steps and 1-step intervals (``n == 1``) are never
scaled, so ``zero-offload`` and ``off`` are unaffected.
"""

from __future__ import annotations

import math
from typing import Literal

DeferredLrScale = Literal["off", "sqrt", "linear"]


def lr_scale(mode: DeferredLrScale, steps: int) -> float:
    """``s(n)``: the factor on the CPU step's learning rate for an interval of ``steps`` steps."""
    if mode == "off" or steps <= 1:
        return 1.0
    if mode == "sqrt":
        return math.sqrt(steps)
    if mode == "linear":
        return float(steps)
    raise ValueError(f"unknown deferred_lr_scale {mode!r}")


def corrected_hyperparams(mode: DeferredLrScale, steps: int, lr: float, weight_decay: float) -> tuple[float, float]:
    """(lr, weight_decay) for the CPU update of an interval of ``steps`` optimizer steps.

    ``off`` (or a 1-step interval) returns the inputs themselves, untouched, so the engine's
    arithmetic is exactly what it was without the option.
    """
    s = lr_scale(mode, steps)
    if s == 1.0:
        return lr, weight_decay
    return lr * s, weight_decay * steps / s
