"""What one optimizer step did and what it cost, for the training loop's log line and the benchmark."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zfctl.offload.ledger import Tab


@dataclass
class StepStats:
    """Per-step instrumentation, plain Python numbers (safe to keep after the next step).

    Device compute (forward/backward) is measured by the training loop itself; everything here is
    the optimizer's share of the step.

    Stall is every host wait inside ``step()`` after the device update was enqueued: gradient
    columns the step had to copy into its slot itself, the
    wait for the CPU worker, the host side of an install, and (hook path) the wait for gradient
    chunks still in flight; plus ``device_wait_ms``, the time the compute stream itself sat
    waiting for a copy (an install's H2D, the device path's copy out), read with events. While the host waits there, the device runs out of queued work, so
    this is the time the device timeline waits on the host or on PCIe (an upper bound: the device
    may still be finishing the update it was given). ``offload_ms`` is the gradient part of it.
    The wait for the step's few scalars (norm, clip factor) is not stall: the device update is
    queued behind their D2H, so the device stays busy while the host waits for them.

    Two numbers need the device's clock: ``device_opt_ms`` and (topk 1) ``grad_norm``. On CUDA
    reading them at once would be a sync per step, so they are filled by :meth:`resolve`, which
    the optimizer calls at the start of the next ``step()`` (one step late, the events have long
    fired) and a caller may call after its own sync. On CPU they are filled at once.
    """

    step: int  # 0-based optimizer step this describes (skipped fp16 steps do not advance it)
    boundary: bool = False  # a CPU update was submitted at the end of this step
    selection: bool = False  # the top-k columns were (re)chosen this step
    warmup: bool = False  # a full synchronous offload step (step < full_warm_up_rounds)
    skipped: bool = False  # fp16 overflow: nothing was updated, the loss scale was lowered
    installed: bool = False  # a finished CPU update was copied into the model params this step
    device_opt_ms: float = 0.0  # the device AdamW (selected columns + dense params)
    stall_ms: float = 0.0  # every host wait inside step() (see the class docstring)
    cpu_step_ms: float = 0.0  # duration of the CPU update that completed this step (0 if none)
    offload_ms: float = 0.0  # gradient D2H into the step's slot done or waited for inside step()
    # Data-parallel bytes this rank sent this step (0 for one process): gradient exchange, score
    # and state exchange at a selection, install broadcasts; ring-model counts (partition.py).
    comm_bytes: int = 0
    selected_fraction: float = 0.0  # share of matrix elements in device-owned columns
    # A selection after the first: the share of the device's columns (selectable matrices, each
    # column once) that stayed on the device (columns/selection.py ``stay_share``); else None.
    select_stay: float | None = None
    grad_norm: float | None = None  # global L2 norm of the (unscaled) gradients, if computed
    loss_scale: float | None = None  # fp16 dynamic loss scale used for this step
    update_interval: int = 0  # length of the latest finished interval (U unless cut short before a
    # re-selection, or chosen by the auto rule); before the first boundary: U, or 0 for auto
    # Where this step's host-path gradient went into its slot (chunks = column ranges, see
    # offload/chunks.py, slots.py). ``early``: left the device during backward (gradient hooks)
    # before step() was entered; ``in_step``: copied by step() itself.
    early_chunks: int = 0
    early_bytes: int = 0
    in_step_chunks: int = 0
    in_step_bytes: int = 0
    # Of stall_ms: the compute stream's own idle time waiting for a copy to land (an install's
    # H2D, the device path's copy out of the last interval), timed with CUDA events; 0 on CPU.
    device_wait_ms: float = 0.0
    budget_waits: int = 0  # hook path: times a hook waited for the cap on gradient temporaries in flight
    # One gradient slot set with overlap (acc_gate.py): writes of the interval that waited for the
    # CPU update to read their chunk, and how long, since the last step. step() path: part of
    # stall_ms; hook path: the hook's wait (the backward's).
    acc_gate_waits: int = 0
    acc_gate_ms: float = 0.0
    d2h_gbps: float | None = None  # the D2H rate measured at construction (bandwidth.py), CUDA only
    # The byte ledger and the wait counts of this step (offload/ledger.py): ``bytes`` and ``waits``
    # below. Work the step handed to a helper thread adds to it when it runs: read after ``flush``.
    tab: Tab = field(default_factory=Tab, repr=False, compare=False)
    _late: list[Callable[[StepStats], None]] = field(default_factory=list, repr=False, compare=False)

    @property
    def bytes(self) -> dict[str, int]:
        """Bytes this step moved by kind (ledger.py ``BYTE_KINDS``: PCIe each way, host memory); a
        copy (its helper-thread work adds to the step's tab until it is done: read after ``flush``)."""
        return self.tab.read()[0]

    @property
    def waits(self) -> dict[str, int]:
        """Waits this step wrote by kind (ledger.py ``WAIT_KINDS``: who waited for what); a copy."""
        return self.tab.read()[1]

    @property
    def wait_ms(self) -> dict[str, float]:
        """How long this step's waits of each kind took (host: wall clock; the compute stream's:
        CUDA events, filled by :meth:`resolve`). Timings, for the bench's gap columns; a copy."""
        return self.tab.read()[2]

    # The totals each way, from the ledger. Adding to them (``stats.d2h_bytes += n``) still works
    # and books the bytes as "unlabelled", which the ledger tests refuse: name a kind instead.
    @property
    def d2h_bytes(self) -> int:
        """Device -> host bytes this step (gradients or the interval sum, migration, scalars)."""
        return self.tab.total("d2h.")

    @d2h_bytes.setter
    def d2h_bytes(self, value: int) -> None:
        self.tab.moved("d2h.unlabelled", value - self.d2h_bytes)

    @property
    def h2d_bytes(self) -> int:
        """Host -> device bytes this step (installed params, migration)."""
        return self.tab.total("h2d.")

    @h2d_bytes.setter
    def h2d_bytes(self, value: int) -> None:
        self.tab.moved("h2d.unlabelled", value - self.h2d_bytes)

    @property
    def host_bytes(self) -> int:
        """Host memory bytes read + written for this step: gradient landing, summing, the CPU
        update it submitted, its install, a migration (complete once its helper work is done)."""
        return self.tab.total("host.")

    @host_bytes.setter
    def host_bytes(self, value: int) -> None:
        self.tab.moved("host.unlabelled", value - self.host_bytes)

    def set_grad_norm(self, host_norm: float | None, norm: torch.Tensor | None, *, cuda: bool) -> None:
        """The gradient norm: as read with the step's scalars, or (topk 1: nothing was synced) read
        from the device one step late on CUDA, at once on CPU."""
        if host_norm is not None:
            self.grad_norm = host_norm
        elif norm is not None:
            def read(st: StepStats, norm: torch.Tensor = norm) -> None:
                st.grad_norm = float(norm.item())

            self.defer(read)
            if not cuda:
                self.resolve()

    def defer(self, fill: Callable[[StepStats], None]) -> None:
        """Queue ``fill(self)`` for :meth:`resolve` (a read of device timing/values)."""
        self._late.append(fill)

    def resolve(self) -> StepStats:
        """Fill the values read from the device late (a sync only if the device is still behind)."""
        late, self._late = self._late, []
        for fill in late:
            fill(self)
        return self


class DeviceClock:
    """Times a device section: wall clock on CPU, CUDA events on GPU (read later, one sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self, stats: StepStats) -> None:
        """Set ``stats.device_opt_ms``: now on CPU, at ``stats.resolve()`` on CUDA (no sync here)."""
        if not self.cuda:
            stats.device_opt_ms = (time.perf_counter() - self.t0) * 1e3
            return
        self.end.record()

        def read(st: StepStats) -> None:
            self.end.synchronize()  # a sync only if resolved before the device got here
            st.device_opt_ms = self.start.elapsed_time(self.end)

        stats.defer(read)
