"""What one optimizer step did and what it cost, for the training loop's log line and the benchmark."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """Per-step instrumentation, plain Python numbers (safe to keep after the next step).

    Device compute (forward/backward) is measured by the training loop itself; everything here is
    the optimizer's share of the step.
    """

    step: int  # 0-based optimizer step this describes (skipped fp16 steps do not advance it)
    boundary: bool = False  # a CPU update was submitted at the end of this step
    selection: bool = False  # the top-k columns were (re)chosen this step
    warmup: bool = False  # a full synchronous offload step (step < full_warm_up_rounds)
    skipped: bool = False  # fp16 overflow: nothing was updated, the loss scale was lowered
    installed: bool = False  # a finished CPU update was copied into the model params this step
    device_opt_ms: float = 0.0  # the device AdamW (selected columns + dense params)
    stall_ms: float = 0.0  # time step() waited for the CPU worker
    cpu_step_ms: float = 0.0  # duration of the CPU update that completed this step (0 if none)
    offload_ms: float = 0.0  # D2H gradient streaming + host accumulation, host wall time
    d2h_bytes: int = 0  # device -> host bytes this step (gradients, migration, small scalars)
    h2d_bytes: int = 0  # host -> device bytes this step (installed params, migration)
    comm_bytes: int = 0  # data-parallel bytes this rank contributed/received (0 for one process)
    selected_fraction: float = 0.0  # share of matrix elements in device-owned columns
    grad_norm: float | None = None  # global L2 norm of the (unscaled) gradients, if computed
    loss_scale: float | None = None  # fp16 dynamic loss scale used for this step
    update_interval: int = 0  # length of the latest finished interval (U unless cut short before a
    # re-selection, or chosen by the auto rule); before the first boundary: U, or 0 for auto
