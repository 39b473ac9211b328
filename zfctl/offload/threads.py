"""How the host cores are split between gradient accumulation and the CPU AdamW update.

With ``overlap_step`` the two run at once: the accumulation thread (stream.py, or the main thread
in ``step()``) adds each step's host-column gradient while the CPU worker (worker.py) updates the
previous interval. Both are memory-bound streaming kernels, so a share of the cores in proportion
to the bytes each moves per element keeps both near the memory bandwidth without one starving
the other:

- accumulation reads a bf16/fp16 gradient (2 B), reads and writes the fp32 sum (8 B; the
  interval's first step only writes it): about 10 B per element per step;
- the AdamW update reads the gradient sum (4 B), reads and writes master, exp_avg, exp_avg_sq
  (24 B): 28 B per element.

So the default gives accumulation ~10/38 of the threads, 10 / (10 + 28) (at least 1, and 1 fewer than all so the
update keeps one), and the update the rest. A few threads already saturate memory for a
streaming kernel, so a small share is not a slowdown; on 16 cores that is 4 + 12.
``zenflow.tuning.accumulate_threads`` overrides the first number. The native pool gives each side its
own pool (native/pool.c), so neither falls back to one thread when the other is running. Thread
counts change timing only: the kernels' bits depend on the run lists alone (native/api.c).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ACC_BYTES, UPDATE_BYTES = 10, 28  # host bytes per element: one accumulation, one AdamW update
ACC_POOL = 1  # the native pool the accumulation's calls run on; the update keeps pool 0


def split_threads(total: int, accumulate_threads: int = 0) -> tuple[int, int]:
    """(accumulation threads, update threads) out of ``total``; ``accumulate_threads`` 0 = auto."""
    total = max(1, total)
    if accumulate_threads:
        acc = min(accumulate_threads, total)
    else:
        acc = min(max(1, round(total * ACC_BYTES / (ACC_BYTES + UPDATE_BYTES))), max(1, total - 1))
    return acc, max(1, total - acc)


def capped(native: Any, threads: int) -> Callable[..., None]:
    """``native.accumulate`` whose calls run on the accumulation pool with at most ``threads``."""

    def accumulate(*args: Any, **kwargs: Any) -> None:
        native.set_thread_role(ACC_POOL, threads)  # thread-local; two cffi calls per chunk
        try:
            native.accumulate(*args, **kwargs)
        finally:
            native.set_thread_role(0, 0)

    return accumulate
