"""Where an interval's host-owned gradient waits for its CPU update: one slot per step.

Every step of an interval, the host-owned gradient columns land by DMA in their own slot, in the
model dtype and laid out in the host column space (a chunk at its ``ch.off``, as the master):
slot ``j`` of the current *set* holds step ``j`` of the interval. Nothing runs on the host per
step; ``step()`` only records the step's coefficient, its unscale ``u_j`` (1 / the fp16 loss
scale, 1.0 otherwise: a host float known before the backward). At the boundary the CPU worker
forms the interval's raw sum ``S`` inside its AdamW pass (native ``adamw_sum``:
``a = fma(g_j, u_j, a)`` per slot in step order, from +0 or from a *carry*), which has the bits of
a per-step fp32 accumulation, and applies the interval's mean clip factor to it as a whole (the
interval-mean rule: the clip factors are the pipeline's, ``Pipeline.clip_sum``, not the slots').

Two sets with ``overlap_step`` (``zenflow.tuning.host_accumulators: 2``): the next interval
writes the other set while the worker reads this one; one set (``1``, hosts short of RAM): each
write of the next interval waits until the worker has read that piece (acc_gate.py). A set has
as many slots as the longest interval: ``update_interval``, or ``tuning.auto_max_interval`` under
``auto``. Host memory: ``slots x sets x itemsize`` per host element (U=4, bf16, two sets: 16 B).

The *carry* of a set is an fp32 partial sum the chain starts from instead of +0: a checkpoint
resumed inside an interval (its saved ``acc``, the raw fp32 sum of the steps before the save) or,
on the device path (no slots), the interval's whole sum copied out of the device. A resumed carry
is allocated for that interval only (4 B per host element) and dropped when its update is handed
to the worker. ``partial_sum_into`` gives what a checkpoint stores mid-interval, one element
range at a time: the same fma chain into the caller's fp32 buffer (a chunk of a checkpoint's
stream, cpu/partial.py), so a resume continues from the bits the uninterrupted run has in
registers, and the save holds no 4 B per host element.

Owners (docs/design.md, "Threads and buffer ownership"): a set's slots are written by the copy
stream (hooks and step(), stream.py) and read by the CPU worker of that interval; ``coefs`` and
``carry`` are the main thread's, handed to the worker by value (``take``).
"""

from __future__ import annotations

import torch

from zfctl.offload.device import pinned


class GradSlots:
    """``sets`` sets of ``per_set`` slots of ``numel`` elements of ``dtype``, with each set's
    recorded coefficients and optional fp32 carry. ``sum_buffer``: a persistent fp32 carry for
    set 0 (the device path's interval sum, page-locked: its D2H lands there)."""

    def __init__(self, numel: int, dtype: torch.dtype, *, per_set: int, sets: int, pin: bool,
                 device: torch.device | None = None, sum_buffer: bool = False) -> None:
        self.numel, self.dtype, self.per_set = numel, dtype, per_set
        self.buffers = [pinned.empty(per_set * numel, dtype, pin=pin, device=device) for _ in range(sets)]
        self.coefs: list[list[float]] = [[] for _ in range(sets)]
        self.carry: list[torch.Tensor | None] = [None] * sets
        self.sum_buffer = sum_buffer
        if sum_buffer:
            self.carry[0] = pinned.empty(numel, torch.float32, pin=pin, device=device, zero=True)

    @property
    def sets(self) -> int:
        return len(self.buffers)

    def slot(self, s: int, j: int) -> torch.Tensor:
        """Slot ``j`` of set ``s`` (a flat view in the host column space)."""
        return self.buffers[s][j * self.numel : (j + 1) * self.numel]

    def used(self, s: int) -> int:
        """Slots of set ``s`` holding a recorded step of the current interval."""
        return len(self.coefs[s])

    def full(self, s: int) -> bool:
        """No slot of set ``s`` is left for another step: the interval must end now."""
        return self.per_set > 0 and self.used(s) >= self.per_set

    def next(self, s: int) -> torch.Tensor:
        """Where this step's gradient lands: the first slot of set ``s`` without a recorded step
        (a skipped fp16 step records nothing, so the next step rewrites its slot)."""
        j = self.used(s)
        assert j < self.per_set, "an interval never has more steps than its set has slots (Pipeline.close_step)"
        return self.slot(s, j)

    def record(self, s: int, coef: float) -> None:
        """The step that landed in ``next(s)`` counts, with coefficient ``coef`` (its unscale u)."""
        self.coefs[s].append(float(coef))

    def take(self, s: int) -> tuple[tuple[torch.Tensor, ...], tuple[float, ...], torch.Tensor | None]:
        """(slots, coefficients, carry) of set ``s``'s interval, for its CPU update; the set is
        empty again (a resumed carry is the update's now: freed with it)."""
        coefs = tuple(self.coefs[s])
        slots = tuple(self.slot(s, j) for j in range(len(coefs)))
        carry = self.carry[s]
        self.coefs[s] = []
        if not self.sum_buffer:
            self.carry[s] = None
        return slots, coefs, carry

    def has_sum(self, s: int) -> bool:
        """Set ``s``'s interval has a partial sum (a recorded step, or a carry)."""
        return bool(self.coefs[s]) or self.carry[s] is not None

    def partial_sum_into(self, s: int, out: torch.Tensor, lo: int, hi: int) -> None:
        """Elements ``[lo, hi)`` of set ``s``'s partial sum so far into ``out`` (fp32, contiguous,
        ``hi - lo`` elements, host), with the worker's rounding: the carry's values, or +0, then
        ``fma(g_j, u_j, a)`` per recorded slot in step order (native ``accumulate``, the same fma
        as ``adamw_sum``). Reads the slots and the carry: the caller makes sure no copy into them
        and no update reading them is in flight (a checkpoint: ``drain``, ``Pipeline.settle``)."""
        from zfctl import _native

        assert self.has_sum(s), "an interval without a step has no partial sum"
        coefs, carry = self.coefs[s], self.carry[s]
        if carry is not None:
            out.copy_(carry[lo:hi])
        for j, c in enumerate(coefs):
            _native.accumulate(out, self.slot(s, j)[lo:hi], scale=c, overwrite=carry is None and j == 0)

    def resume_buffer(self) -> torch.Tensor:
        """Where a checkpoint's unfinished sum is loaded (then handed to ``resume``): a new fp32
        buffer, the resumed interval's carry, 4 B per host element until its update."""
        return torch.empty(self.numel, dtype=torch.float32)

    def resume(self, s: int, carry: torch.Tensor | None) -> None:
        """Set ``s`` continues an interval from ``carry`` (fp32, or None: a fresh interval); the
        other sets hold nothing."""
        for i in range(self.sets):
            self.coefs[i] = []
            if not self.sum_buffer:
                self.carry[i] = None
        if carry is not None:
            self.carry[s] = carry

    def discard(self) -> None:
        """Forget every recorded step (a live optimizer rolled back by a load)."""
        self.resume(0, None)

    def release(self) -> None:
        """Unpin the page-locked buffers (``close()``); they stay valid as pageable memory."""
        for buf in self.buffers:
            pinned.release(buf)
        if self.sum_buffer and self.carry[0] is not None:
            pinned.release(self.carry[0])
