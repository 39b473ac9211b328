"""The CPU worker thread: runs the native AdamW over the host-owned columns at each boundary.

One thread, one update at a time. ``submit`` hands it the interval's gradient (its per-step slots
with their coefficients, and a carry: slots.py), the hyper-parameters of this boundary and the
waits it must do first (the last copy into the interval's slots, the install DMA still reading
the master); from then until ``wait`` returns, the worker owns the host master, moments and that
interval's slots (see the table in ``host``). One native call per step-counter group forms the
interval's sum and runs AdamW on it in one pass (``adamw_sum``: ``CpuWorker._adamw``). The native
kernels release the GIL and split each call over their own thread pool, so the main thread keeps
launching device work meanwhile. Results never depend on timing: the worker touches only buffers
the main thread leaves alone until ``wait``, and the main thread decides, by step count alone,
when to wait and install.

One exception, with one slot set and ``overlap_step`` (acc_gate.py): the next interval writes the
slots the update reads. Then the update carries ``pieces`` (the chunks in the order the gradient
path writes them), runs piece by piece, and publishes after each one how far it has read
(``AccGate.passed``); each write of the next interval waits for that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from zfctl.offload.correction import DeferredLrScale, corrected_hyperparams, inner_steps
from zfctl.offload.host import HostState
from zfctl.offload.ledger import NOWHERE, Ledger, count_adamw_sum
from zfctl.offload.pcie import bind_device


@dataclass(frozen=True)
class CpuUpdate:
    """Everything one CPU AdamW update needs, passed by value at submission. The interval's
    gradient is ``sum_j coefs[j] * slots[j]`` on top of ``carry``, formed with the rounding of a
    per-step fp32 accumulation (slots.py, native ``adamw_sum``)."""

    slots: tuple[torch.Tensor, ...]  # the interval's per-step gradient slots (model dtype), in step order
    coefs: tuple[float, ...]  # each slot's coefficient: its step's clip factor / fp16 loss scale
    carry: torch.Tensor | None  # fp32 partial sum the chain starts from (a resumed interval, the device path's sum)
    grad_scale: float  # 1 / steps in the interval: the kernel uses the interval-mean gradient
    groups: list[tuple[int, torch.Tensor]]  # (1-based step, runs) per step-counter group
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    repeat: int = 1  # AdamW steps per element, all with this gradient (correction.inner_steps)
    # One shared slot set (acc_gate.py): (offset, elements) of each chunk, in the order the next
    # interval writes them; the update runs and publishes piece by piece. None: one pass.
    pieces: tuple[tuple[int, int], ...] | None = None


def cpu_update(mode: DeferredLrScale, n: int, grad: tuple[tuple[torch.Tensor, ...], tuple[float, ...],
               torch.Tensor | None], groups: Callable[[int], list], hp: dict[str, float],
               pieces: tuple[tuple[int, int], ...] | None = None) -> CpuUpdate:
    """The update of an interval of ``n`` steps: its gradient (``grad``: slots, coefficients,
    carry, from ``Pipeline.take``) as the interval mean (``grad_scale = 1/n``), the boundary's
    hyper-parameters with ``zenflow.deferred_lr_scale``'s correction for the ``n`` steps the
    deferred columns stood still (correction.py: a scaled lr, or ``repeat``: n steps), and the
    step-counter groups (``groups(steps)``: HostState.update_groups, which advances them);
    ``pieces``: the shared slot set's read order (acc_gate.py), or None."""
    lr, wd = corrected_hyperparams(mode, n, hp["lr"], hp["weight_decay"])
    reps = inner_steps(mode, n)
    slots, coefs, carry = grad
    return CpuUpdate(slots, coefs, carry, 1.0 / n, groups(reps), lr, hp["beta1"], hp["beta2"], hp["eps"], wd,
                     reps, pieces)


def clip_runs(runs: torch.Tensor, ends: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The part of a sorted, non-overlapping run list that lies in elements [lo, hi) (``ends``:
    each run's end, ``runs[:, 0] + runs[:, 1]``, contiguous)."""
    if hi <= lo:
        return runs[:0]
    i0 = int(torch.searchsorted(ends, lo, right=True))  # the first run ending after lo
    i1 = int(torch.searchsorted(ends, hi, right=False))  # runs before i1 end at or before hi
    if i1 < runs.shape[0] and int(runs[i1, 0]) < hi:
        i1 += 1  # the run that straddles hi
    out = runs[i0:i1].clone()
    if out.shape[0]:
        start = max(int(out[0, 0]), lo)
        out[0, 1] = int(out[0, 0]) + int(out[0, 1]) - start
        out[0, 0] = start
        out[-1, 1] = min(int(out[-1, 0]) + int(out[-1, 1]), hi) - int(out[-1, 0])
    return out


class CpuWorker:
    """A single background thread owning the host state while an update is in flight."""

    ledger: Ledger = NOWHERE  # where its bytes and fences are counted (ledger.py; the optimizer's own)

    def __init__(self, host: HostState, device: torch.device) -> None:
        from zfctl import _native  # raises UserError("run make setup") when the library is missing

        self.native = _native
        self._host = host
        # The thread's first call binds it to the optimizer's device: its waits are CUDA event
        # syncs, which would otherwise create a context on GPU 0 (pcie.bind_device).
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="zenflow-cpu",
                                                                   initializer=bind_device, initargs=(device,))
        self._future: Future | None = None
        self.threads = 0  # cap on the update's native threads (threads.py); 0 = all
        # Tests only: called with a piece's index before the worker reads it (a slow worker makes
        # a missing wait on the shared slot set show as wrong bits).
        self.before_piece: Callable[[int], None] | None = None

    @property
    def busy(self) -> bool:
        """True while an update is submitted and not yet waited for."""
        return self._future is not None

    def run(self, update: CpuUpdate) -> float:
        """Apply one update on the calling thread; returns its duration in ms."""
        t0 = time.perf_counter()
        if update.pieces is None:
            for step, runs in update.groups:
                self._adamw(update, step, runs)
        else:  # AdamW is per element: the same bits in any cut of the runs (native/kernels.h)
            ends = [runs[:, 0] + runs[:, 1] for _, runs in update.groups]
            for i, (off, n) in enumerate(update.pieces):
                if self.before_piece is not None:
                    self.before_piece(i)
                for (step, runs), end in zip(update.groups, ends):
                    part = clip_runs(runs, end, off, off + n)
                    if part.shape[0]:
                        self._adamw(update, step, part)
                self._host.gate.passed(i + 1)  # the next interval may overwrite pieces 0..i now
        # Nothing to clear: the set's next interval writes every host chunk of each slot it uses.
        return (time.perf_counter() - t0) * 1e3

    def _adamw(self, update: CpuUpdate, step: int, runs: torch.Tensor) -> None:
        """The one native call of an update (per step-counter group, per piece): the interval's
        sum formed from its slots and AdamW on it, one pass. Host bytes per element: 24 (master
        and moments read and written) + each slot's itemsize (+ 4 with a carry)."""
        h = self._host
        count_adamw_sum(self.ledger, h.master, update.slots, carry=update.carry, runs=runs,
                        out=h.upload)  # host.sum + host.update, the submitting step's tab
        self.native.adamw_sum(
            h.master, h.exp_avg, h.exp_avg_sq, update.slots, update.coefs, carry=update.carry, step=step,
            lr=update.lr, beta1=update.beta1, beta2=update.beta2, eps=update.eps,
            weight_decay=update.weight_decay, grad_scale=update.grad_scale, runs=runs, repeat=update.repeat,
            out=h.upload,  # bf16/fp16: the install source (host.py upload)
        )

    def submit(self, update: CpuUpdate, waits: Sequence[Callable[[], Any]] = ()) -> None:
        """Start ``update`` in the background; the worker first calls each of ``waits`` (the last
        copy into the interval's slots: stream.py; the device path's sum copy out: device_acc.py;
        the install DMA still reading the master: chunks.py). At most one update is ever in flight. An update
        with ``pieces`` closes the slot gate here, on the submitting thread, so that no
        write issued after this call can pass before the worker has read its piece."""
        if self._pool is None:
            raise RuntimeError("ZenFlowOptimizer is closed")
        if self._future is not None:
            raise RuntimeError("a CPU update is already in flight; wait() for it first")
        gate = self._host.gate if update.pieces is not None else None
        if gate is not None:
            gate.start([off for off, _ in update.pieces or ()])

        def run() -> float:
            try:
                self.native.set_thread_role(0, self.threads)  # this worker thread's share of the cores
                for wait in waits:
                    wait()  # worker thread: the slots have landed, the master is free, only after these
                return self.run(update)
            finally:
                if gate is not None:
                    gate.end()  # done reading (or failed: no writer may wait forever)

        self._future = self._pool.submit(self.ledger.charged(run))  # counted into the submitting step

    def wait(self) -> float:
        """Block until the in-flight update is done; its duration in ms (re-raises its error)."""
        future, self._future = self._future, None
        if future is None:
            return 0.0
        return future.result()

    def close(self) -> None:
        """Finish any in-flight update and stop the thread. Idempotent."""
        if self._pool is not None:
            try:
                self.wait()
            finally:
                self._pool.shutdown(wait=True)
                self._pool = None
