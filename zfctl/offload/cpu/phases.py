"""The host side's phases of one optimizer step, in step() order (optimizer.py): the step's
gradient into its slot and its unscale and clip factor recorded (``host_update``), the interval's end handed
to the CPU worker (``boundary``), and the finished update installed into the params (``install``,
called by the pipeline when its schedule says), and before them the D2H of the few scalars the
host reads (``start_scalars``). Functions of the facade: they read its parts
(pipeline, gradient path, selector, installer) and own no state of their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from zfctl.offload.cpu.worker import cpu_update
from zfctl.offload.device.pcie import count_waits
from zfctl.offload.stats import StepStats

if TYPE_CHECKING:
    from zfctl.offload.columns.selector import Selector
    from zfctl.offload.config import ZenFlowConfig
    from zfctl.offload.cpu.auto_interval import IntervalPolicy
    from zfctl.offload.cpu.host import HostState
    from zfctl.offload.cpu.pipeline import Pipeline
    from zfctl.offload.device.device_adam import DeviceAdam
    from zfctl.offload.device.install import Installer
    from zfctl.offload.grads.device_to_host import GradientPath, Transfers
    from zfctl.offload.grads.scaler import GradientScale
    from zfctl.offload.parallel.exchange import GradExchange
    from zfctl.offload.parallel.sharded import ShardedParams


class Facade(Protocol):
    """The parts of the optimizer (optimizer.py ``ZenFlowOptimizer``) these phases read: named
    here, so this module needs nothing of the facade's own module (no import cycle)."""

    config: ZenFlowConfig
    device: torch.device
    params: list[torch.Tensor]
    scale: GradientScale
    policy: IntervalPolicy
    selector: Selector
    device_state: DeviceAdam
    exchange: GradExchange | None
    sharded: ShardedParams | None
    host: HostState | None
    transfers: Transfers | None
    gradient_path: GradientPath
    pipeline: Pipeline
    installer: Installer


def start_scalars(opt: Facade, norm: torch.Tensor | None, clip: torch.Tensor | None,
                  grads: list[torch.Tensor | None], warm: bool,
                  totals: list[torch.Tensor] | None) -> Callable[[], torch.Tensor]:
    """Start the D2H of [norm, clip factor k, (auto) selected and total L1 mass per matrix],
    ordered before the device update, so the host waits for these few numbers only. ``k``
    itself, not the coefficient ``k u``: the interval-mean rule sums the ``k`` (host_update)."""
    assert opt.transfers is not None
    one = torch.ones((), device=opt.device)
    parts = [norm if norm is not None else one * 0, clip if clip is not None else one]
    if opt.policy.auto and opt.selector.selected and not warm:
        masses = opt.selector.masses(grads, totals)
        parts += opt.sharded.sum_list(masses) if opt.sharded is not None else masses  # whole matrices
    return opt.transfers.d2h.fetch(torch.stack(parts))


def host_update(opt: Facade, scalars: Callable[[], torch.Tensor], grads: list[torch.Tensor | None], warm: bool,
                 hp: dict[str, float], stats: StepStats) -> tuple[float, float]:
    """4. the other columns' gradient into the step's slot, with its unscale, and the step's clip
    factor into the interval's; 5. a lagged install; 6. the boundary. Returns the gradient norm
    read with the scalars, and when the host work began."""
    values = scalars().tolist()  # sync point: waits for the norm/clip/masses only
    # Not stall: the device update is queued behind the scalars, the device keeps busy.
    # Everything from here on is host work the device does not overlap with: stall.
    host_norm, host_clip, masses = values[0], values[1], values[2:]
    unscale = opt.scale.unscale
    tail = c = time.perf_counter()
    # The interval-mean rule (docs/design.md, "Algorithm", step 5): the step's slot holds its raw
    # gradient and counts with its unscale u (slots.py); its clip factor k, read itself (not
    # coef / u: coef is rounded), joins the interval's sum of factors, whose mean the boundary
    # applies. The device path adds u * g on the device (add_device); it has no slots.
    opt.gradient_path.add_host(opt.pipeline.slot(), stats)
    opt.pipeline.record(unscale, host_clip)
    stats.offload_ms = (time.perf_counter() - c) * 1e3
    if opt.pipeline.install_due():  # zenflow.install_lag: the last boundary's update lands now
        opt.pipeline.collect(stats)
    if opt.pipeline.close_step(force=warm or opt.selector.due(opt.pipeline.t + 1)):
        boundary(opt, stats, warm, hp)
    elif opt.policy.auto and opt.selector.selected:
        k, cols = opt.selector.shapes()
        coef = unscale * host_clip  # the masses of the gradient the device columns take (k u)
        opt.policy.observe([m * coef for m in masses[0::2]], [m * coef for m in masses[1::2]], k, cols)
    return host_norm, tail


def boundary(opt: Facade, stats: StepStats, warm: bool, hp: dict[str, float]) -> None:
    """End the interval: submit its CPU update (and, synchronous modes, wait and install it).
    The update waits for what the gradient path says (its ``finish``, called once the previous
    update is collected) and for the install's DMA."""
    assert opt.host is not None and opt.transfers is not None  # only the host path has intervals
    n, clip_mean = opt.pipeline.end_interval()
    background = opt.config.overlap_step and not warm
    # One slot set that the next interval writes while this update reads it: the update goes
    # piece by piece in the path's write order, and the writes follow (acc_gate.py).
    order = opt.gradient_path.write_order() if background and opt.host.grads.sets == 1 else None
    grad = opt.pipeline.take()  # the interval's slots, their unscales and carry (slots.py)
    # The deferred columns stood still for n steps: zenflow.deferred_lr_scale scales this one
    # step for them, or ('repeat') takes n steps (correction.py; 'off' takes one, as is). Their
    # gradient is the interval's mean times its mean clip factor (``clip_mean``; worker.py).
    update = cpu_update(opt.config.deferred_lr_scale, n, grad, opt.host.update_groups, hp,
                        pieces=tuple(order) if order is not None else None, clip_mean=clip_mean)
    # Its bytes (each slot read, master and moments, the upload copy) are counted by the worker.
    opt.pipeline.submit(update, stats, background=background, prepare=lambda: opt.gradient_path.finish(stats))


def install(opt: Facade, stats: StepStats) -> None:
    """The host's finished update into the model params (the pipeline decides when), on the
    install stream (install.py); each param's device-owned columns are put back after its chunks."""
    assert opt.host is not None and opt.transfers is not None  # only the host path installs
    p, sel = opt.params, opt.selector.selected
    # Its bytes are counted by the ring (ledger.py).
    _, fence = opt.installer.run(opt.transfers.h2d, opt.transfers.chunks, opt.host.install_source, p,
                                  lambda slot: opt.device_state.write_params(p, sel, only=[slot]))
    opt.host.install_fence = fence  # the source's next writer waits for the DMA (HostState)
    count_waits(stats, opt.installer.take_waits(), "device.install")  # no hooks: compute waits for it all
    if opt.exchange is not None:  # each owner's columns to every rank (collectives)
        stats.comm_bytes += opt.exchange.share_installed()
