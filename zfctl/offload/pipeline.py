"""The host path's state machine: one owner for the interval counters, the accumulators and the
one-update-in-flight rule.

Per optimizer step the optimizer asks three things of it: which accumulator to fill (``acc``),
whether this step ends an interval (``close_step``), and, at a boundary, to hand the interval to
the CPU worker (``submit``). Everything that decides *when* a result lands is here and depends on
step counts only, never on thread timing:

* synchronous (``overlap_step`` off, or a warm-up step): submit, wait, install at once;
* overlapped: install the previous interval's result first (waiting if it is still running: the
  only stall of this mode), then submit this interval and switch to the other accumulator. At
  most one update is ever in flight, and the installed values are exactly one interval stale.
  A re-selection does not change that: it takes only the entering columns' part of the update in
  flight (``prioritize``), and the rest installs on this schedule like any other update.
  With one host accumulator (``zenflow.tuning.host_accumulators``) there is no other one: ``cur``
  stays 0 and the next interval's first writes wait for the update to have read each chunk
  (acc_gate.py; the optimizer hands the update its ``pieces``). The same values, other waits.
* overlapped with a lag ``L`` (``zenflow.tuning.install_lag``): as above, but the result is installed at
  the end of the ``L``-th step after the boundary that submitted it (``install_due``), or at the
  next boundary if that comes first; the step waits if the update has not finished by then.

``collect`` (``flush``, and the schedule above) waits and installs now. ``settle`` (checkpoints,
loads) waits without installing: the result becomes *pending*, which the saved state records, and
the next boundary after a resume installs it exactly where the uninterrupted run would. Both also
wait for the jobs a selection deferred to the worker (``defer``: the leaving columns' state
scattered into the host buffers), so no install, checkpoint, load or next update reads those
rows before they are written.

Without host columns (topk_ratio 1) only the step counter is used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from zfctl.offload.auto_interval import IntervalPolicy
from zfctl.offload.host import HostState, fill
from zfctl.offload.ledger import NOWHERE, Ledger, counted_wait
from zfctl.offload.stats import StepStats
from zfctl.offload.worker import CpuUpdate, CpuWorker, PieceWaits

Install = Callable[[StepStats], None]


class Pipeline:
    """Counters (steps, interval length), the accumulator in use, the CPU worker and pending install."""

    ledger: Ledger = NOWHERE  # where its waits are counted (ledger.py; the optimizer's own)

    def __init__(self, host: HostState | None, policy: IntervalPolicy, *, overlap: bool,
                 install: Install, lag: int = 0, device: torch.device | None = None,
                 update_threads: int = 0) -> None:
        self.host = host
        self.policy = policy
        self.overlap = overlap
        self.lag = lag  # install a background update this many steps after its boundary; 0: at the next one
        self.age = 0  # steps completed since the last background submit (counts while one is outstanding)
        self._install = install
        self.worker = CpuWorker(host, device or torch.device("cpu")) if host is not None else None
        if self.worker is not None:
            self.worker.threads = update_threads  # its share of the cores (threads.py); 0 = all
        self.t = 0  # optimizer steps taken (skipped fp16 steps excluded)
        self.interval_len = 0  # steps accumulated in the current interval
        # The interval's clip factors that are not in acc (release.py adds raw gradients): the
        # boundary scales the mean gradient by clip_sum / interval_len. n x 1.0 without release.
        self.clip_sum = 0.0
        self.raw_sums = False  # release.py: the sums hold raw gradients (ZenFlowOptimizer._raw_sums)
        self.last_interval = 0 if policy.auto else policy.fixed
        self.cur = 0  # which accumulator the main thread fills
        self.pending_install = False  # a finished CPU update waits to be copied into the model

    # -- per step -------------------------------------------------------------------------------
    @property
    def acc(self) -> torch.Tensor:
        """The accumulator the main thread (or the gradient stream) fills this interval."""
        assert self.host is not None, "only the host path (host columns) has accumulators"
        return self.host.acc[self.cur]

    @property
    def busy(self) -> bool:
        """True while a CPU update is in flight."""
        return self.worker is not None and self.worker.busy

    @property
    def first_of_interval(self) -> bool:
        """No gradient has been added to ``acc`` in this interval yet."""
        return self.interval_len == 0

    def close_step(self, force: bool, clip: float = 1.0) -> bool:
        """Count one accumulated step (``clip``: its clip factor when the sum does not hold it,
        release.py); True when it ends the interval (``force``: it must)."""
        self.interval_len += 1
        self.clip_sum += clip
        return self.policy.is_boundary(self.interval_len, force)

    def clip_mean(self) -> float:
        """The interval's mean clip factor not yet applied to its sum: exactly 1.0 when every
        step's factor is in the sum or is 1 (a sum of n ones is n)."""
        return self.clip_sum / self.interval_len if self.interval_len else 1.0

    def discard_interval(self) -> None:
        """Drop the unfinished interval's sum (release.py: an fp16 overflow step's hooks added
        into it): the next step writes the accumulator afresh."""
        self.interval_len, self.clip_sum = 0, 0.0

    def advance(self) -> None:
        """One optimizer step done (not called for a skipped fp16 step)."""
        self.t += 1
        self.age += 1

    def install_due(self) -> bool:
        """True when an outstanding background update must be installed at the end of this step
        (``lag`` steps after the boundary that submitted it)."""
        return self.lag > 0 and self.age == self.lag and (self.busy or self.pending_install)

    def end_interval(self) -> int:
        """Close the interval's counters; returns its length (the mean's divisor)."""
        n = self.interval_len
        self.interval_len, self.last_interval, self.clip_sum = 0, n, 0.0
        self.policy.reset()
        return n

    def submit(self, update: CpuUpdate, stats: StepStats, *, background: bool,
               prepare: Callable[[], Callable[[], Any] | None]) -> None:
        """Hand one interval to the CPU worker; see the module docstring for the two modes.

        ``prepare``: called once the previous update is collected and before this one starts, it
        returns the wait for what is still writing ``update.acc`` (the gradient path's ``finish``:
        the hook path's last accumulation job, or the device path's copy of the interval sum into
        its one host accumulator, which the previous update may still have been reading; that one
        is a ``PieceWaits``, one copy event per matrix, which the update waits for piece by
        piece). The worker also waits for the install DMA that may still read the install source,
        the upload buffer or the master it writes (HostState.install_fence).
        """
        host, worker = self.host, self.worker
        assert host is not None and worker is not None, "only the host path (host columns) has boundaries"
        stats.boundary = True
        if background:
            self.collect(stats)  # install the previous interval's update (one interval stale) ...
        after, dma = prepare(), _install_wait(host)
        if isinstance(after, PieceWaits):  # the sum lands matrix by matrix: the update follows it
            pieces = tuple((off, n, counted_wait(self.ledger, "worker.grads", w) if w is not None else None)
                           for off, n, w in after.pieces)
            update, after = replace(update, fences=pieces), None
        waits = [counted_wait(self.ledger, kind, w) for kind, w in (("worker.grads", after), ("worker.install", dma))
                 if w is not None]
        worker.submit(update, waits)
        if background:  # ... then this one runs in the background (one accumulator: cur stays)
            self.cur = (self.cur + 1) % len(host.acc)
            self.age = 0
        else:
            self.collect(stats)

    def collect(self, stats: StepStats) -> None:
        """Wait for an in-flight update (the caller counts the wait as stall) and install any result."""
        self.settle(stats)
        if self.pending_install:
            self._install(stats)
            stats.installed = True
            self.pending_install = False

    def settle(self, stats: StepStats | None = None) -> None:
        """Wait for an in-flight update without installing it: its result becomes pending. Then
        for the jobs deferred behind it (a selection's leaving state, ``defer``)."""
        if self.worker is None:
            return
        if self.worker.busy:  # self.busy, spelled out for the type checker
            with self.ledger.waiting("host.cpu_update"):
                ms = self.worker.wait()
            if stats is not None:
                stats.cpu_step_ms = ms
            self.pending_install = True
        self.worker.join_deferred()  # normally long done: it ran right after the update

    def prioritize(self, runs: torch.Tensor) -> float:
        """A selection: the update in flight updates these elements first; returns once it has
        (ms waited, 0 when none is in flight). worker.py ``prioritize``. Counted as one
        ``host.priority`` wait whenever an update is in flight by the step count (``busy``),
        finished or not, so the count does not depend on thread timing (ledger.py)."""
        if self.worker is None:
            return 0.0
        if not self.worker.busy:  # self.busy, spelled out for the type checker
            return self.worker.prioritize(runs)
        with self.ledger.waiting("host.priority"):
            return self.worker.prioritize(runs)

    def defer(self, job: Callable[[], Any]) -> None:
        """Run ``job`` on the worker thread behind the update in flight (``settle`` waits for it)."""
        assert self.worker is not None, "only the host path (host columns) has a worker"
        self.worker.defer(self.ledger.charged(job))  # its bytes and waits: the step that deferred it

    def close(self) -> None:
        """Stop the worker (finishing its update, not installed). Idempotent."""
        if self.worker is not None:
            self.worker.close()

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self, live_acc: torch.Tensor | None = None) -> dict[str, Any]:
        """Counters, the policy and the unfinished interval's sum, made canonical in place
        (``HostState.canonicalize``; ``live_acc``: where that sum lives when it is not the current
        host accumulator: the device path's device buffer). Not copies: a checkpoint streams them.

        An in-flight update is waited for first (a stall at checkpoint time only). Its result is
        then pending: the master holds it, and the install after a resume reads it from there.
        """
        self.settle()
        sd: dict[str, Any] = {
            "counters": {"t": self.t, "interval_len": self.interval_len, "last_interval": self.last_interval,
                         "cur": self.cur, "pending_install": self.pending_install, "age": self.age,
                         "clip_sum": self.clip_sum, "raw_sums": self.raw_sums},
            "policy": self.policy.state_dict(),
        }
        if self.host is not None:
            acc = self.acc if live_acc is None else live_acc
            sd["acc"] = self.host.canonicalize(acc, fresh=self.interval_len == 0)
        return sd

    def load_state_dict(self, sd: dict[str, Any], live_acc: torch.Tensor | None = None) -> None:
        """Restore counters, policy and the unfinished interval's sum (into ``live_acc`` when it is
        not the host accumulator). A saved ``upload`` (states written before the install read the
        master) is ignored: it held the master's values rounded to the model dtype, which the load
        computes again from the master, to the same bits (state.py, ``HostState.refresh_upload``)."""
        if self.worker is not None:
            if self.worker.busy:  # self.busy, spelled out for the type checker
                self.worker.wait()  # discard: everything it wrote is overwritten below
            self.worker.join_deferred()  # a selection's leaving state: written before it is overwritten
        c = sd["counters"]
        self.t, self.interval_len, self.last_interval = c["t"], c["interval_len"], c["last_interval"]
        self.pending_install = c["pending_install"]
        self.age = c.get("age", 0)  # absent before install_lag existed, where nothing reads it
        self.clip_sum = float(c.get("clip_sum", self.interval_len))  # absent before release_grads: all 1
        self.raw_sums = bool(c.get("raw_sums", False))
        self.policy.load_state_dict(sd["policy"])
        if self.host is None:
            return
        self.cur = c["cur"] % len(self.host.acc)
        for i, acc in enumerate(self.host.acc):
            if live_acc is None and i == self.cur:
                fill(acc, sd["acc"])
            else:
                acc.zero_()
        if live_acc is not None:
            fill(live_acc, sd["acc"])


def _install_wait(host: HostState) -> Callable[[], Any] | None:
    """The wait for the install DMA still reading ``host.install_source`` (the upload buffer, or an
    fp32 model's master), handed to the worker by value."""
    fence, host.install_fence = host.install_fence, None
    return fence.synchronize if fence is not None else None
