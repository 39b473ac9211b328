"""The CPU worker thread: runs the native AdamW over the host-owned columns at each boundary.

One thread, one update at a time. ``submit`` hands it an accumulator, the hyper-parameters of
this boundary and the waits it must do first (the accumulation of the interval's last gradient,
the install DMA still reading the master); from then until ``wait`` returns, the worker owns the
host master, moments and that accumulator (see the table in ``host``). The native kernels release the GIL
and split each call over their own thread pool, so the main thread keeps launching device work
and accumulating the next interval meanwhile. Results never depend on timing: the worker touches
only buffers the main thread leaves alone until ``wait``, and the main thread decides, by step
count alone, when to wait and install.
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
from zfctl.offload.pcie import bind_device


@dataclass(frozen=True)
class CpuUpdate:
    """Everything one CPU AdamW update needs, passed by value at submission."""

    acc: torch.Tensor  # the interval's accumulated (clipped, unscaled) gradient sum
    grad_scale: float  # 1 / steps accumulated: the kernel uses the interval-mean gradient
    groups: list[tuple[int, torch.Tensor]]  # (1-based step, runs) per step-counter group
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    repeat: int = 1  # AdamW steps per element, all with this gradient (correction.inner_steps)


def cpu_update(mode: DeferredLrScale, n: int, acc: torch.Tensor, groups: Callable[[int], list],
               hp: dict[str, float]) -> CpuUpdate:
    """The update of an interval of ``n`` steps: the interval-mean gradient (``grad_scale = 1/n``),
    the boundary's hyper-parameters with ``zenflow.deferred_lr_scale``'s correction for the ``n``
    steps the deferred columns stood still (correction.py: a scaled lr, or ``repeat``: n steps),
    and the step-counter groups (``groups(steps)``: HostState.update_groups, which advances them)."""
    lr, wd = corrected_hyperparams(mode, n, hp["lr"], hp["weight_decay"])
    reps = inner_steps(mode, n)
    return CpuUpdate(acc, 1.0 / n, groups(reps), lr, hp["beta1"], hp["beta2"], hp["eps"], wd, reps)


class CpuWorker:
    """A single background thread owning the host state while an update is in flight."""

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

    @property
    def busy(self) -> bool:
        """True while an update is submitted and not yet waited for."""
        return self._future is not None

    def run(self, update: CpuUpdate) -> float:
        """Apply one update on the calling thread; returns its duration in ms."""
        t0 = time.perf_counter()
        h = self._host
        for step, runs in update.groups:
            self.native.adamw_step(
                h.master, update.acc, h.exp_avg, h.exp_avg_sq, step=step, lr=update.lr,
                beta1=update.beta1, beta2=update.beta2, eps=update.eps,
                weight_decay=update.weight_decay, grad_scale=update.grad_scale, runs=runs,
                repeat=update.repeat,
            )
        # No zeroing: the first step of the interval after next overwrites acc (chunks.py, stream.py).
        return (time.perf_counter() - t0) * 1e3

    def submit(self, update: CpuUpdate, waits: Sequence[Callable[[], Any]] = ()) -> None:
        """Start ``update`` in the background; the worker first calls each of ``waits`` (the
        accumulation of the interval's last gradient: stream.py, device_acc.py; the install DMA
        still reading the master: chunks.py). At most one update is ever in flight."""
        if self._pool is None:
            raise RuntimeError("ZenFlowOptimizer is closed")
        if self._future is not None:
            raise RuntimeError("a CPU update is already in flight; wait() for it first")

        def run() -> float:
            self.native.set_thread_role(0, self.threads)  # this worker thread's share of the cores
            for wait in waits:
                wait()  # worker thread: the accumulator is complete, the master free, only after these
            return self.run(update)

        self._future = self._pool.submit(run)

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
