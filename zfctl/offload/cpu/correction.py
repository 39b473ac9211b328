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

``sqrt`` and ``linear`` change only the learning rate, never the moments: ``exp_avg``/``exp_avg_sq`` and the per-column
step counter keep meaning "one Adam update absorbed per CPU step", so a column's state stays
valid when it migrates to the device (``selection``) and bias correction is unchanged. Decoupled
weight decay is kept at ``n`` steps' worth, ``n * lr * wd`` to first order, for every mode (the
kernel applies ``lr' * wd'``, so ``wd' = wd * n / s``); with ``off`` that is the paper's
``lr * wd`` per interval, unchanged. Warm-up steps and 1-step intervals (``n == 1``) are never
scaled, so ``zero-offload`` and ``off`` are unaffected.

``repeat`` is not a scale but the exact statement of "the ``n`` AdamW steps the interval stood
for, with what the CPU knows (the interval-mean gradient ``gbar``)": the CPU runs ``n`` AdamW
steps on each deferred element, all with ``gbar``, each with its own bias correction and decoupled
weight decay, at the boundary's lr; the column's step counter advances by ``n``. This is not one
closed-form step (``m <- b1^n m + (1 - b1^n) gbar`` and a single parameter move): the parameter
moves ``n`` times, each by the moments of that inner step. It differs from AdamW only in that
every inner step sees ``gbar`` instead of that step's own gradient (and in the overlap's one
interval of staleness). The moments and counter then mean "``n`` Adam updates absorbed", as they
do for a device column, so a column migrating between the two paths keeps a consistent state. The
native kernel runs the ``n`` steps on each element while it is in registers
(``zfctl/_native.py`` ``adamw_step(repeat=n)``), so the memory traffic is one step's and the cost
is ``n`` times the arithmetic (measured: docs/design.md, section "Algorithm").
"""

from __future__ import annotations

import math
from typing import Literal

DeferredLrScale = Literal["off", "sqrt", "linear", "repeat"]
MODES: tuple[str, ...] = ("off", "sqrt", "linear", "repeat")


def lr_scale(mode: DeferredLrScale, steps: int) -> float:
    """``s(n)``: the factor on the CPU step's learning rate for an interval of ``steps`` steps."""
    if mode in ("off", "repeat") or steps <= 1:  # repeat: n steps at the unscaled lr
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


def inner_steps(mode: DeferredLrScale, steps: int) -> int:
    """AdamW steps the CPU takes per deferred element for an interval of ``steps`` steps: ``steps``
    with ``repeat``, else 1."""
    return max(1, steps) if mode == "repeat" else 1
