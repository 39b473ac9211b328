"""How many native threads the CPU AdamW update takes.

Nothing runs native code on the host per step any more: each step's gradient columns land in
their own slot by DMA (slots.py, stream.py), and the CPU update sums them inside its AdamW pass.
So the update takes every native thread (``cpu_threads``), with or without ``overlap_step``, on
the host paths and on the device path alike. The native pool (native/pool.c) still serves each
calling thread on its own pool; thread counts change timing only, the kernels' bits depend on
the run lists alone (native/api.c).
"""

from __future__ import annotations


def split_threads(total: int) -> int:
    """Native threads of the CPU update out of ``total`` (``cpu_threads``): all of them."""
    return max(1, total)
