"""When does a CPU-update interval end? Fixed every U steps, or adaptively (``update_interval: auto``).

The adaptive rule (docs/design.md, section "Algorithm"). For every matrix that has both device and host columns
(``0 < k < cols``), after each step of the current interval:

* deferred mass ``D`` = sum over the interval's steps of the L1 norm of its non-selected gradient
  divided by the number of non-selected columns (per-column mass the CPU has not applied yet);
* selected mass ``A`` = mean over the interval's steps of the L1 norm of its selected gradient
  divided by ``k`` (per-column mass the device applies every step);
* the matrix *qualifies* when ``D >= A``.

When at least ``auto_ratio`` of those matrices qualify, the rule *fires* and the NEXT step is a
boundary (its gradient is still accumulated, then the CPU update runs). Bounds: a boundary
happens no earlier than ``auto_min_interval`` steps into an interval (a fired rule waits) and no
later than ``auto_max_interval``. Statistics reset at every boundary. Reading: the CPU catches up
once a deferred column has gathered as much gradient as a device column receives in one step, so
the interval adapts to how concentrated the gradient is (10x concentration -> about 10 steps).
With no participating matrix (topk_ratio 0) the rule is vacuously true: boundaries every 2 steps,
or ``auto_min_interval`` if larger.

The masses are the gradients as applied (after clipping and unscaling), summed on the device and
brought to the host with the step's other scalars; the rule itself runs here in float64, so it
costs no extra device sync and can be tested on a synthetic stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from zfctl.offload.config import Interval


class IntervalPolicy:
    """Decides, step by step, which steps end an interval."""

    def __init__(self, update_interval: Interval, *, auto_ratio: float = 0.99,
                 min_interval: int = 1, max_interval: int = 16) -> None:
        self.auto = update_interval == "auto"
        self.fixed = 0 if self.auto else int(update_interval)
        self.ratio, self.min, self.max = float(auto_ratio), int(min_interval), int(max_interval)
        self.reset()

    def reset(self) -> None:
        """Forget the interval's statistics (called at every boundary)."""
        self.steps = 0
        self.selected: list[float] = []  # per matrix: sum over steps of selected mass / k
        self.deferred: list[float] = []  # per matrix: sum over steps of deferred mass / (cols - k)
        self.pending = False  # the rule fired: the next step (at or past min) is a boundary

    def is_boundary(self, length: int, force: bool = False) -> bool:
        """Whether the step that brings the interval to ``length`` steps ends it."""
        if force:
            return True
        if not self.auto:
            return length >= self.fixed
        return length >= self.max or (self.pending and length >= self.min)

    def observe(self, selected: Sequence[float], total: Sequence[float], k: Sequence[int],
                cols: Sequence[int]) -> bool:
        """Add one non-boundary step's L1 masses (per participating matrix); True if the rule fires.

        ``selected[i]`` is the L1 mass of matrix i's selected columns, ``total[i]`` of all its
        columns; ``k[i]`` and ``cols[i]`` its column counts.
        """
        if not self.selected:
            self.selected = [0.0] * len(selected)
            self.deferred = [0.0] * len(selected)
        self.steps += 1
        qualify = 0
        for i, (s, tot, ki, ci) in enumerate(zip(selected, total, k, cols)):
            self.selected[i] += s / ki
            self.deferred[i] += max(tot - s, 0.0) / (ci - ki)
            qualify += self.deferred[i] >= self.selected[i] / self.steps
        fired = qualify >= self.ratio * len(selected)
        self.pending = self.pending or fired
        return fired

    def state_dict(self) -> dict:
        return {"steps": self.steps, "selected": list(self.selected), "deferred": list(self.deferred),
                "pending": self.pending}

    def load_state_dict(self, sd: dict) -> None:
        self.steps = int(sd["steps"])
        self.selected = [float(x) for x in sd["selected"]]
        self.deferred = [float(x) for x in sd["deferred"]]
        self.pending = bool(sd["pending"])
