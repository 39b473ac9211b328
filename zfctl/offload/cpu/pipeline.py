"""The host path's state machine: one owner for the interval counters, the gradient slots' sets and
the one-update-in-flight rule.

Per optimizer step the optimizer asks four things of it: which slot this step's gradient lands in
(``slot``), to record that step's unscale and clip factor (``record``), whether this step ends an interval
(``close_step``), and, at a boundary, to hand the interval to the CPU worker (``take``, then
``submit``). Everything that decides *when* a result lands is here and depends on step counts
only, never on thread timing:

* synchronous (``overlap_step`` off, or a warm-up step): submit, wait, install at once;
* overlapped: install the previous interval's result first (waiting if it is still running: the
  only stall of this mode), then submit this interval and switch to the other slot set. At
  most one update is ever in flight, and the installed values are exactly one interval stale.
  A re-selection does not change that: it takes only the entering columns' part of the update in
  flight (``prioritize``), and the rest installs on this schedule like any other update.
  With one slot set (``zenflow.tuning.host_accumulators: 1``) there is no other one: ``cur``
  stays 0 and each write of the next interval waits for the update to have read that piece
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

The clip rule is the interval mean (docs/design.md, "Algorithm", step 5): the host-owned columns'
sum is raw, ``S = sum_t u_t g_t`` (slots.py, or the device path's device sum), and the pipeline
keeps the interval's clip factors, ``clip_sum = sum_t k_t``; the boundary hands the CPU update
``clip_sum / n`` (``end_interval``), which it applies as ``grad_scale = (clip_sum / n) / n``.

Checkpoints inside an interval store the raw sum so far (``acc``: formed from the slots with the
worker's rounding, chunk by chunk as it is written, partial.py), ``clip_sum`` and the interval
length, and mark the sum raw (``raw_sums``): the format of the states written before the slots
under ``release_grads``, which therefore load exactly. A resume continues the sum as the set's
carry and the clip sum as it was, bit for bit. A state without ``raw_sums`` (written by the
per-step rule, whose ``acc`` has each step's ``k_t u_t`` applied) loads as a raw sum whose saved
steps count ``k = 1`` each: exact when they did not clip; a warning says so once.

Without host columns (topk_ratio 1) only the step counter is used.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from zfctl.offload.cpu.auto_interval import IntervalPolicy
from zfctl.offload.cpu.host import HostState, fill
from zfctl.offload.cpu.partial import FillRange, PartialSum, zero_dead
from zfctl.offload.cpu.worker import CpuUpdate, CpuWorker, PieceWaits
from zfctl.offload.grads.slots import GradSlots
from zfctl.offload.ledger import NOWHERE, Ledger, counted_wait
from zfctl.offload.stats import StepStats

Interval = tuple[tuple[torch.Tensor, ...], tuple[float, ...], torch.Tensor | None]


class StateNote(UserWarning):
    """Something a user resuming a run should know about the loaded state (the run continues):
    zfctl/train/progress.py prints it as a ``note:`` line."""


Install = Callable[[StepStats], None]


class Pipeline:
    """Counters (steps, interval length), the slot set in use, the CPU worker and pending install."""

    ledger: Ledger = NOWHERE  # where its waits are counted (ledger.py; the optimizer's own)

    def __init__(self, host: HostState | None, policy: IntervalPolicy, *, overlap: bool,
                 install: Install, lag: int = 0, device: torch.device | None = None,
                 update_threads: int = 0) -> None:
        self.host = host
        self.grads: GradSlots | None = host.grads if host is not None else None
        self.policy = policy
        self.overlap = overlap
        self.lag = lag  # install a background update this many steps after its boundary; 0: at the next one
        self.age = 0  # steps completed since the last background submit (counts while one is outstanding)
        self._install = install
        self.worker = CpuWorker(host, device or torch.device("cpu")) if host is not None else None
        if self.worker is not None:
            self.worker.threads = update_threads  # its share of the cores (threads.py); 0 = all
        self.t = 0  # optimizer steps taken (skipped fp16 steps excluded)
        self.interval_len = 0  # steps in the current interval (a resumed carry's included)
        self.clip_sum = 0.0  # the interval's clip factors summed, in step order (Python float: double)
        self.last_interval = 0 if policy.auto else policy.fixed
        self.cur = 0  # the slot set this interval writes
        self.pending_install = False  # a finished CPU update waits to be copied into the model

    # -- per step -------------------------------------------------------------------------------
    def slot(self) -> torch.Tensor | None:
        """Where this step's host-owned gradient lands (slots.py); None on the device path."""
        if self.grads is None or self.grads.per_set == 0:
            return None
        return self.grads.next(self.cur)

    def record(self, unscale: float, clip: float) -> None:
        """This step's gradient (in ``slot()``; the device path: in its device sum) counts with its
        unscale ``u`` in the raw sum, and its clip factor ``k`` joins the interval's (host paths)."""
        if self.grads is not None and self.grads.per_set:
            self.grads.record(self.cur, unscale)
        self.clip_sum += clip

    @property
    def busy(self) -> bool:
        """True while a CPU update is in flight."""
        return self.worker is not None and self.worker.busy

    @property
    def first_of_interval(self) -> bool:
        """No step of this interval has been taken yet."""
        return self.interval_len == 0

    def close_step(self, force: bool) -> bool:
        """Count one step; True when it ends the interval (``force``: it must; or its slot set
        is full, which only ``update_interval: auto`` can reach: its sets hold
        ``auto_max_interval`` slots, the longest interval it allows)."""
        self.interval_len += 1
        full = self.grads is not None and self.grads.full(self.cur)
        return self.policy.is_boundary(self.interval_len, force or full)

    def advance(self) -> None:
        """One optimizer step done (not called for a skipped fp16 step)."""
        self.t += 1
        self.age += 1

    def install_due(self) -> bool:
        """True when an outstanding background update must be installed at the end of this step
        (``lag`` steps after the boundary that submitted it)."""
        return self.lag > 0 and self.age == self.lag and (self.busy or self.pending_install)

    def end_interval(self) -> tuple[int, float]:
        """Close the interval's counters; returns its length ``n`` (the mean's divisor) and the
        mean of its clip factors, ``clip_sum / n`` (exactly 1.0 without clipping: a sum of n ones
        is n; exactly ``k`` for an interval of one step)."""
        n, clip = self.interval_len, self.clip_sum
        self.interval_len, self.last_interval, self.clip_sum = 0, n, 0.0
        self.policy.reset()
        return n, clip / n if n else 1.0

    def take(self) -> Interval:
        """The ending interval's (slots, unscales, carry) for its CPU update (slots.py)."""
        assert self.grads is not None, "only the host path (host columns) has boundaries"
        return self.grads.take(self.cur)

    def submit(self, update: CpuUpdate, stats: StepStats, *, background: bool,
               prepare: Callable[[], Callable[[], Any] | None]) -> None:
        """Hand one interval to the CPU worker; see the module docstring for the two modes.

        ``prepare``: called once the previous update is collected and before this one starts, it
        returns the wait for what is still writing the update's gradient (the gradient path's
        ``finish``: the last copy into a slot, or the device path's copy of the interval sum into
        its one host buffer, which the previous update may still have been reading; that one is a
        ``PieceWaits``, one copy event per matrix, which the update waits for piece by piece). The
        worker also waits for the install DMA that may still read the install source, the upload
        buffer or the master it writes (HostState.install_fence).
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
        if background:  # ... then this one runs in the background (one slot set: cur stays)
            self.cur = (self.cur + 1) % host.grads.sets
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

    def request(self, runs: torch.Tensor) -> Any:
        """A selection, before it enqueues its moves: the update in flight is asked to update
        these elements first (worker.py ``request``; no wait). ``hand`` must follow."""
        return self.worker.request(runs) if self.worker is not None else None

    def hand(self, req: Any, fill: Callable[[], Any] | None) -> None:
        """The migration's fill (migration.py), for the worker to run right after ``req``'s
        elements are updated, or now on the worker thread when no update is in flight."""
        if self.worker is not None:
            self.worker.hand(req, fill)

    def wait_entering(self, req: Any, fill: Callable[[], Any] | None) -> float:
        """Wait until the entering columns are updated and ``fill`` has run (ms). One
        ``host.priority`` wait whenever an update is in flight by the step count (``busy``), as
        ``prioritize``; else one ``host.migrate_fill`` wait when there is a fill."""
        if self.worker is None:
            return 0.0
        kind = "host.priority" if self.worker.busy else "host.migrate_fill" if fill is not None else None
        if kind is None:
            return self.worker.wait_request(req, fill)
        with self.ledger.waiting(kind):
            return self.worker.wait_request(req, fill)

    def defer(self, job: Callable[[], Any]) -> None:
        """Run ``job`` on the worker thread behind the update in flight (``settle`` waits for it)."""
        assert self.worker is not None, "only the host path (host columns) has a worker"
        self.worker.defer(self.ledger.charged(job))  # its bytes and waits: the step that deferred it

    def close(self) -> None:
        """Stop the worker (finishing its update, not installed). Idempotent."""
        if self.worker is not None:
            self.worker.close()

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self, live_acc: torch.Tensor | None = None, *, stream: bool = False) -> dict[str, Any]:
        """Counters (``clip_sum`` and ``raw_sums`` among them), the policy and the unfinished
        interval's raw fp32 sum, canonical: on the device path ``live_acc``, its device buffer,
        made canonical in place (``HostState.canonicalize``); on the host paths formed from the
        slots (``GradSlots.partial_sum_into``): with ``stream``, a ``PartialSum`` whose chunks
        are formed as the checkpoint writes them (no buffer of the sum; partial.py), else a new
        buffer (4 B per host element while the caller holds it). An interval without a step gives
        zeros that take no memory (an expanded scalar).

        An in-flight update is waited for first (a stall at checkpoint time only). Its result is
        then pending: the master holds it, and the install after a resume reads it from there.
        """
        self.settle()
        sd: dict[str, Any] = {
            "counters": {"t": self.t, "interval_len": self.interval_len, "last_interval": self.last_interval,
                         "cur": self.cur, "pending_install": self.pending_install, "age": self.age,
                         "clip_sum": self.clip_sum, "raw_sums": True},
            "policy": self.policy.state_dict(),
        }
        if self.host is not None:
            assert self.grads is not None
            fresh = self.interval_len == 0
            if live_acc is not None:
                sd["acc"] = self.host.canonicalize(live_acc, fresh=fresh)
            elif fresh:
                sd["acc"] = torch.zeros(1).expand(self.grads.numel)  # nothing is live: zeros, no memory
            else:
                acc = PartialSum(self._fill_range(self.cur), 0, (self.grads.numel,))
                sd["acc"] = acc if stream else acc.load()
        return sd

    def _fill_range(self, s: int) -> FillRange:
        """Elements [lo, hi) of set ``s``'s partial sum, canonical (partial.py)."""
        host, grads = self.host, self.grads
        assert host is not None and grads is not None

        def fill(out: torch.Tensor, lo: int, hi: int) -> None:
            grads.partial_sum_into(s, out, lo, hi)
            zero_dead(host.layout, host.device_owned, out, lo, hi)

        return fill

    def load_state_dict(self, sd: dict[str, Any], live_acc: torch.Tensor | None = None) -> None:
        """Restore counters, policy, the unfinished interval's raw sum and its clip sum: the sum
        into ``live_acc`` (the device path's device buffer), or as the current set's carry (host
        paths; ``sd["acc"]`` is the fp32 buffer the loader filled, None for an interval without a
        step). A state without ``raw_sums`` (the per-step rule's) counts its saved steps' clip
        factors as 1 (module docstring), with a warning. A saved ``upload`` (states written
        before the install read the master) is ignored: it held the master's values rounded to
        the model dtype, which the load computes again from the master, to the same bits
        (state.py, ``HostState.refresh_upload``)."""
        if self.worker is not None:
            if self.worker.busy:  # self.busy, spelled out for the type checker
                self.worker.wait()  # discard: everything it wrote is overwritten below
            self.worker.join_deferred()  # a selection's leaving state: written before it is overwritten
        c = sd["counters"]
        self.t, self.interval_len, self.last_interval = c["t"], c["interval_len"], c["last_interval"]
        self.pending_install = c["pending_install"]
        self.age = c.get("age", 0)  # absent before install_lag existed, where nothing reads it
        self.clip_sum = _saved_clip_sum(c) if self.interval_len else 0.0
        self.policy.load_state_dict(sd["policy"])
        if self.host is None:
            return
        assert self.grads is not None
        self.cur = c["cur"] % self.grads.sets
        acc = sd.get("acc")
        if live_acc is not None and acc is not None:
            fill(live_acc, acc)
            acc = live_acc
        self.grads.resume(self.cur, acc if live_acc is None and self.interval_len else None)


def _saved_clip_sum(counters: dict[str, Any]) -> float:
    """The clip sum of a saved unfinished interval: as saved when its sum is raw (``raw_sums``:
    this format, and the states written before the slots under ``release_grads``); else the
    per-step rule's state, whose sum has each step's clip factor applied already: its steps
    count 1 each, exact when they did not clip (warned once)."""
    n = int(counters["interval_len"])
    if counters.get("raw_sums") and counters.get("clip_sum") is not None:
        return float(counters["clip_sum"])
    warnings.warn(f"this optimizer state was saved {n} step(s) into an interval by an earlier zfctl, "
                  "whose interval sum has each step's clip factor in it; the resumed interval counts those "
                  "steps with factor 1 (the interval-mean clip rule, docs/design.md): exact where they did "
                  "not clip", StateNote, stacklevel=4)
    return float(n)


def _install_wait(host: HostState) -> Callable[[], Any] | None:
    """The wait for the install DMA still reading ``host.install_source`` (the upload buffer, or an
    fp32 model's master), handed to the worker by value."""
    fence, host.install_fence = host.install_fence, None
    return fence.synchronize if fence is not None else None
