"""The timed loop: one configuration, one trial, one linear function.

Every configuration gets a fresh model (same seed, same inputs) and a fresh `ZenFlowOptimizer`.
The first `warmup` steps are untimed (allocator, kernel autotuning, the initial selection and
the first CPU updates). Then each step is cut into forward / backward / optimizer by three clock
marks, and the optimizer's own `StepStats` supply the device-optimizer, CPU-step and stall times
and the PCIe bytes (read after the window's sync: the device timings are filled late, see
StepStats.resolve). Nothing in the window synchronises the device beyond what the optimizer
itself does (see timing.py); the window ends with one synchronisation.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zfctl.bench.grid import BenchConfig
from zfctl.bench.model import BenchModel
from zfctl.bench.timing import clock_for, device_sync
from zfctl.offload.config import ZenFlowConfig


@dataclass
class StepRecord:
    """One timed step. `update` = a CPU-update boundary (StepStats.boundary)."""

    update: bool
    step_ms: float  # forward + backward + step() + zero_grad(), on the device timeline
    fwd_ms: float
    bwd_ms: float
    opt_ms: float  # step() + zero_grad() as the bench sees it (device AdamW, transfers, stall)
    device_opt_ms: float  # StepStats.device_opt_ms
    offload_ms: float  # StepStats.offload_ms: D2H gradient streaming + host accumulation (host wall)
    cpu_step_ms: float  # StepStats.cpu_step_ms: 0.0 unless a CPU update completed this step
    stall_ms: float  # StepStats.stall_ms: every host wait inside step() (D2H, accumulation, worker)
    d2h_bytes: int
    h2d_bytes: int
    skipped: bool  # fp16 overflow: the step did no update
    host_bytes: int = 0  # StepStats.host_bytes: host memory read + written for this step (all kinds)
    comm_bytes: int = 0  # StepStats.comm_bytes: data-parallel bytes sent (0: the bench is one process)
    selection: bool = False  # StepStats.selection: the step re-chose the device's columns
    select_stay: float | None = None  # StepStats.select_stay: the share of device columns that stayed
    # The step's ledger (StepStats.bytes / waits / wait_ms, offload/ledger.py): bytes by kind, waits
    # by kind and how long they took. The bound (bound.py) is computed from these.
    bytes: dict[str, int] = field(default_factory=dict)
    waits: dict[str, int] = field(default_factory=dict)
    wait_ms: dict[str, float] = field(default_factory=dict)

    @property
    def busy_ms(self) -> float:
        """Device work of the step: forward + backward + device optimizer."""
        return self.fwd_ms + self.bwd_ms + self.device_opt_ms


@dataclass
class TrialResult:
    records: list[StepRecord]
    window_wall_ms: float  # host wall clock over the whole window, incl. the final sync
    loss_first: float
    loss_last: float


@dataclass
class ConfigResult:
    config: BenchConfig
    warmup_steps: int
    steps: int
    trials: list[TrialResult] = field(default_factory=list)

    @property
    def records(self) -> list[StepRecord]:
        """All timed steps of all trials, pooled."""
        return [r for t in self.trials for r in t.records]


def run_trial(
    model: BenchModel,
    zf: ZenFlowConfig,
    *,
    warmup: int,
    steps: int,
    device: torch.device,
    opt_kwargs: dict,
) -> TrialResult:
    """Train `warmup` untimed then `steps` timed steps; return one record per timed step."""
    from zfctl.offload import ZenFlowOptimizer, vocab_matrices  # imported late: --help stays fast

    if len(model.batches) < warmup + steps:
        raise ValueError(f"model has {len(model.batches)} batches, needs {warmup + steps}")
    module, loss_fn, batches = model.module, model.loss_fn, model.batches
    clock = clock_for(device)
    with ZenFlowOptimizer(list(module.named_parameters()), zf, vocab_params=vocab_matrices(module),
                          **opt_kwargs) as opt:
        opt.attach_install_waits(module)  # each layer's forward waits for its own install, as in training
        for i in range(warmup):
            loss = loss_fn(module, batches[i])
            opt.prepare_backward(final=True)  # gradients stream to the host during backward
            opt.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        device_sync(device)

        marks, stats, losses = [], [], []
        t0 = time.perf_counter()
        for i in range(warmup, warmup + steps):
            m0 = clock.mark()
            loss = loss_fn(module, batches[i])
            m1 = clock.mark()
            opt.prepare_backward(final=True)
            opt.scale_loss(loss).backward()
            m2 = clock.mark()
            st = opt.step()
            opt.zero_grad(set_to_none=True)
            m3 = clock.mark()
            marks.append((m0, m1, m2, m3))
            stats.append(st)  # read after the window's one sync (its device timings are late)
            losses.append(loss.detach())
        clock.resolve()
        for st in stats:
            st.resolve()  # the device has passed every event: no further wait
        wall_ms = (time.perf_counter() - t0) * 1e3
        opt.flush()  # install the last in-flight CPU update (untimed) before closing
    # The ledgers are read after close(): a step's helper-thread work (its CPU update) is in it.

    records = []
    for (m0, m1, m2, m3), st in zip(marks, stats, strict=True):
        records.append(
            StepRecord(
                update=bool(st.boundary),
                step_ms=clock.elapsed_ms(m0, m3),
                fwd_ms=clock.elapsed_ms(m0, m1),
                bwd_ms=clock.elapsed_ms(m1, m2),
                opt_ms=clock.elapsed_ms(m2, m3),
                device_opt_ms=float(st.device_opt_ms),
                offload_ms=float(st.offload_ms),
                cpu_step_ms=float(st.cpu_step_ms),
                stall_ms=float(st.stall_ms),
                d2h_bytes=int(st.d2h_bytes),
                h2d_bytes=int(st.h2d_bytes),
                skipped=bool(st.skipped),
                host_bytes=int(st.host_bytes),
                comm_bytes=int(st.comm_bytes),
                selection=bool(st.selection),
                select_stay=st.select_stay,
                bytes=dict(st.bytes),
                waits=dict(st.waits),
                wait_ms=dict(st.wait_ms),
            )
        )
    return TrialResult(records, wall_ms, float(losses[0]), float(losses[-1]))


def run_config(
    config: BenchConfig,
    build_model: Callable[[int], BenchModel],
    base: ZenFlowConfig,
    *,
    warmup: int,
    steps: int,
    trials: int,
    device: torch.device,
    opt_kwargs: dict,
) -> ConfigResult:
    """All trials of one configuration, each on a freshly built model."""
    zf = config.zenflow_config(base)
    result = ConfigResult(config, warmup, steps)
    for _ in range(trials):
        model = build_model(warmup + steps)
        try:
            result.trials.append(
                run_trial(model, zf, warmup=warmup, steps=steps, device=device, opt_kwargs=opt_kwargs)
            )
        finally:
            del model
            release_memory(device)
    return result


def release_memory(device: torch.device) -> None:
    """Free the previous configuration's model, optimizer state and pinned buffers."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
