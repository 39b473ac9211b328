"""Know the bytes: what each optimizer step moved and which waits it wrote, counted where they happen.

Every place that moves bytes across PCIe or through host memory, and every place a thread or the
compute stream waits for another one, adds to the optimizer's :class:`Ledger`:

    ledger.moved("d2h.grad", nbytes)     # where a gradient chunk is copied device to host
    ledger.waited("host.scalars")        # where the training thread waits for the step's scalars

(or through the pcie.py helpers that wait and count in one call: ``host_wait``, ``device_wait``).
The ledger hands each step a :class:`Tab`, which ``StepStats`` exposes as ``bytes`` and ``waits``
(``dict[str, int]``, kind -> bytes / number of waits). A step's tab opens when the previous step
closed (so the gradient hooks of its backward count into it) and closes at the end of its
``step()``. Work a step issues to a helper thread (an accumulation job, the CPU update) is charged
to that step's tab however late it runs (:meth:`Ledger.charged`): read a step's host bytes after
the work is done (``flush``, ``close``), never its timing.

Counted are the *waits written*, not whether they blocked: a wait for an event that has already
fired is still a dependency the thread enforces, and counting the points keeps the counts
deterministic (tests hold them exactly; tests/offload/test_offload_ledger.py).

The kinds are a closed set (``BYTE_KINDS``, ``WAIT_KINDS``, each with what it means): a new place
that moves bytes or waits adds its kind here with one line, and ``moved``/``waited`` refuse a kind
that is not listed, so nothing is counted under a name nobody documented. docs/design.md,
"Transfer scheduling" (sync points) and "Performance model" (the bound) say what each costs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

BYTE_KINDS: dict[str, str] = {
    # PCIe, device to host
    "d2h.grad": "gradient columns of one step (hook path, step() path): whole column ranges, model dtype",
    "d2h.sum": "the device path's fp32 interval sum, once per interval",
    "d2h.scalars": "the step's norm, clip factor and (auto interval) masses",
    "d2h.migrate": "a selection's leaving columns: state rows, and on the release path their gradient; "
                   "the new column ids with the old counters (one small D2H)",
    # PCIe, host to device
    "h2d.install": "an install: updated host columns into the params",
    "h2d.migrate": "a selection's entering columns: state rows, and on the release path their gradient; "
                   "the moves' device-side ids",
    # host memory, read + written
    "host.land": "gradient writes into host memory: a step's gradient slot (its DMA, a missing gradient's -0.0), "
                 "the carry layout's landing ring slot (its DMA), the step()-path ring's host slots, the device "
                 "path's sum",
    "host.fold": "the carry layout (carry.py): a landed chunk's ring slot read and the fp32 carry read and written "
                 "(written only on an interval's first step, and a missing gradient's +0 there)",
    "host.sum": "summing gradients: the CPU update's read of each gradient slot (adamw_sum), or of the "
                "device path's fp32 sum, and an accumulation outside the update (a checkpoint's interval sum)",
    "host.update": "the CPU AdamW's read + write of master and moments (and the copy it writes, if any)",
    "host.install": "an install's read of its host source",
    "host.migrate": "a selection's host gather/scatter of state rows (and released gradients); the leaving "
                    "columns' counters and upload-buffer entries written",
    "host.stage": "a selection's page-locked staging (in ring, out buffer, ids), written and read",
    # bytes counted through StepStats' d2h_bytes/h2d_bytes/host_bytes setters by code that does not
    # name a kind: tests fail on them (name the kind here instead)
    "d2h.unlabelled": "d2h bytes added to StepStats.d2h_bytes without a kind",
    "h2d.unlabelled": "h2d bytes added to StepStats.h2d_bytes without a kind",
    "host.unlabelled": "host bytes added to StepStats.host_bytes without a kind",
}

WAIT_KINDS: dict[str, str] = {
    # the training thread (or a gradient hook on it) blocks until ...
    "host.scalars": "... the step's scalars have landed (ring.py fetch): once per step",
    "host.cpu_update": "... the CPU update in flight is done (pipeline.py settle: collect, a drain)",
    "host.install_dma": "... the last install's DMA no longer reads the master (host.py wait_install)",
    "host.hook_budget": "... an earlier chunk's D2H, the temporaries in flight being over budget (stream.py)",
    "host.slot_gate": "... one slot set (or the carry): the CPU update in flight to have read the piece a write "
                      "overwrites (acc_gate.py; counted when it blocks, as it depends on the worker's progress)",
    "host.ring_full": "... the carry layout: a free landing ring slot, the fold of an earlier chunk (carry.py; "
                      "CUDA only, counted when it blocks, as it depends on the fold thread's progress)",
    "host.fold_drain": "... every fold into the carry issued so far (carry.py drain: checkpoints, loading, a "
                       "release selection reading the carry, closing; CUDA only)",
    "host.slot_fill": "... the last copy into the slot, before a missing gradient's -0.0 fill (stream.py _fill)",
    "host.slot_drain": "... every gradient copy into a slot (stream.py drain: checkpoints, loading, closing)",
    "host.migrate_ids": "... a selection's new column ids and old counters: one D2H (migration.py Mover.fetch)",
    "host.priority": "... the CPU update in flight has updated a selection's entering columns and run the fill "
                     "after them (worker.py wait_request; zero2: prioritize, no fill)",
    "host.migrate_slot": "... a selection's in ring is free: the last selection's H2D (migration.py Mover.move)",
    "host.migrate_fill": "... the CPU worker's fill of a selection's in ring, where no update is in flight "
                         "(pipeline.py wait_entering; with one in flight it is part of host.priority)",
    "host.migrate_out": "... a selection's out buffer to drain, where a selection leaves more than "
                        "zenflow.tuning.staging_mb: the rows in it written into the host (migration.py _make_room: "
                        "one per drain, and one per piece's D2H it waits for)",
    "host.migrate_land": "... a release step's leaving gradient columns' D2H, before the step's slot takes them "
                         "(selector.py land)",
    # the compute stream waits (on the device) for ...
    "device.install": "... an install chunk's H2D copy (ring.py h2d)",
    "device.sum_copy": "... a matrix's copy out of the last interval sum (device_acc.py add)",
    "device.migrate": "... a selection's entering state (the migration's in stream), before the device AdamW",
    # the carry layout's fold thread waits (CUDA only) for ...
    "fold.copy": "... a chunk's D2H into its landing ring slot, before folding it into the carry (carry.py)",
    # the CPU worker waits, before its update, for ...
    "worker.grads": "... the interval's gradient sum to be complete (the path's fence)",
    "worker.install": "... the install DMA still reading the master",
    # the CPU worker, filling a selection's in ring (migration.py fill), waits for ...
    "worker.migrate_slot": "... an in-ring slot's last H2D, where a selection brings in more than the ring holds",
    # the CPU worker waits, behind the update, before writing a selection's leaving rows, for ...
    "worker.migrate": "... the last install's DMA and each out piece's D2H (migration.py Departure)",
}

F = TypeVar("F", bound=Callable[..., Any])


class Tab:
    """The bytes and waits of one step, filled from any thread (a lock per addition). ``wait_ms``:
    how long the waits of each kind took (host waits by the wall clock, the compute stream's from
    CUDA events, read one step late): timings for the bench, never for tests."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.waits: dict[str, int] = {}
        self.wait_ms: dict[str, float] = {}
        self._lock = threading.Lock()

    def moved(self, kind: str, nbytes: int) -> None:
        if kind not in BYTE_KINDS:
            raise KeyError(f"byte kind {kind!r} is not in ledger.BYTE_KINDS: add it there with what it counts")
        if not nbytes:
            return
        with self._lock:
            self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)

    def waited(self, kind: str, n: int = 1, ms: float = 0.0) -> None:
        if kind not in WAIT_KINDS:
            raise KeyError(f"wait kind {kind!r} is not in ledger.WAIT_KINDS: add it there with who waits for what")
        with self._lock:
            self.waits[kind] = self.waits.get(kind, 0) + n
            self.wait_ms[kind] = self.wait_ms.get(kind, 0.0) + ms

    def read(self) -> tuple[dict[str, int], dict[str, int], dict[str, float]]:
        """Copies of (bytes, waits, wait_ms), taken under the lock: a helper thread may still add."""
        with self._lock:
            return dict(self.bytes), dict(self.waits), dict(self.wait_ms)

    def total(self, prefix: str) -> int:
        """Bytes of every kind starting with ``prefix`` (``"d2h."``, ``"h2d."``, ``"host."``)."""
        with self._lock:
            return sum(v for k, v in self.bytes.items() if k.startswith(prefix))


class Ledger:
    """One optimizer's counters: the open step's tab, and which tab a helper thread charges."""

    def __init__(self) -> None:
        self._open = Tab()
        self._local = threading.local()  # .tab: the tab this thread charges, when not the open one

    def tab(self) -> Tab:
        """The tab this thread counts into now: the one it was given (:meth:`charging`), else the
        open step's."""
        charged = getattr(self._local, "tab", None)
        return charged if charged is not None else self._open

    def moved(self, kind: str, nbytes: int) -> None:
        """``nbytes`` of kind ``kind`` (``BYTE_KINDS``) moved now."""
        self.tab().moved(kind, nbytes)

    def waited(self, kind: str, ms: float = 0.0) -> None:
        """One wait of kind ``kind`` (``WAIT_KINDS``) written here, which took ``ms``."""
        self.tab().waited(kind, ms=ms)

    @contextlib.contextmanager
    def waiting(self, kind: str) -> Iterator[None]:
        """One wait of kind ``kind``: the block is the wait, its wall time what it cost."""
        tab, t0 = self.tab(), time.perf_counter()
        try:
            yield
        finally:
            tab.waited(kind, ms=(time.perf_counter() - t0) * 1e3)

    def close(self) -> Tab:
        """End the open step: return its tab and open the next step's."""
        tab, self._open = self._open, Tab()
        return tab

    @contextlib.contextmanager
    def charging(self, tab: Tab) -> Iterator[Tab]:
        """Count what this thread does inside the block into ``tab`` (work outside any step, or
        issued by an earlier one)."""
        before = getattr(self._local, "tab", None)
        self._local.tab = tab
        try:
            yield tab
        finally:
            self._local.tab = before

    def charged(self, fn: F) -> F:
        """``fn`` that, wherever and whenever it runs, counts into the tab current here and now:
        a job handed to a helper thread is charged to the step that issued it."""
        tab = self.tab()

        def run(*args: Any, **kwargs: Any) -> Any:
            with self.charging(tab):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]


NOWHERE = Ledger()  # the class default of every counting component until an optimizer wires its own


def elements(numel: int, runs: torch.Tensor | None) -> int:
    """Elements a native call touches: the run list's total length, or all ``numel``."""
    return numel if runs is None else int(runs[:, 1].sum())


def count_accumulate(ledger: Ledger, acc: torch.Tensor, grad: torch.Tensor, *, runs: torch.Tensor | None = None,
                     overwrite: bool = False, **_: Any) -> None:
    """What ``_native.accumulate`` moves: per element of its runs, the gradient read, and the fp32
    sum written (``overwrite``: the interval's first step) or read and written."""
    n = elements(acc.numel(), runs)
    ledger.moved("host.sum", n * (grad.element_size() + (4 if overwrite else 8)))


def count_adamw(ledger: Ledger, param: torch.Tensor, grad: torch.Tensor, *, runs: torch.Tensor | None = None,
                out: torch.Tensor | None = None, **_: Any) -> None:
    """What ``_native.adamw_step`` moves in its one pass (``repeat`` steps included): the gradient
    sum read (``host.sum``), master and both moments read and written, ``out`` written (``host.update``)."""
    n = elements(param.numel(), runs)
    ledger.moved("host.sum", n * grad.element_size())
    ledger.moved("host.update", n * (24 + (out.element_size() if out is not None else 0)))


def count_adamw_sum(ledger: Ledger, param: torch.Tensor, slots: Sequence[torch.Tensor], *,
                    carry: torch.Tensor | None = None, runs: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, **_: Any) -> None:
    """What ``_native.adamw_sum`` moves in its one pass: each gradient slot read and the fp32 carry
    read, if any (``host.sum``: the interval's sum is formed in registers, never written), master
    and both moments read and written, ``out`` written (``host.update``)."""
    n = elements(param.numel(), runs)
    ledger.moved("host.sum", n * (sum(s.element_size() for s in slots) + (4 if carry is not None else 0)))
    ledger.moved("host.update", n * (24 + (out.element_size() if out is not None else 0)))


def counted_wait(ledger: Ledger, kind: str, wait: Callable[[], Any]) -> Callable[[], Any]:
    """``wait`` that counts one wait of ``kind`` into the tab of the thread that runs it (the CPU
    worker's fences: charged to the step that submitted the update)."""

    def run() -> Any:
        with ledger.waiting(kind):
            return wait()

    return run


def counted_accumulate(accumulate: Callable[..., None], ledger: Ledger) -> Callable[..., None]:
    """``accumulate`` (``_native.accumulate``'s signature) that counts its bytes into ``ledger``
    on whichever thread calls it."""

    def run(acc: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> None:
        count_accumulate(ledger, acc, grad, **kwargs)
        accumulate(acc, grad, **kwargs)

    return run
