"""ZenFlowOptimizer: AdamW split between the device (important columns) and the CPU (the rest).

A facade over the parts that do the work (docs/design.md, "Algorithm": the exact semantics):
``layout`` (where every parameter's state lives), ``Selector`` (which columns the device owns,
and when that is chosen again), ``DeviceAdam`` (the device half), ``HostState`` (the host half),
a ``GradientPath`` chosen once at construction (how the other columns' gradients are copied
device to host: device_to_host.py), ``Pipeline`` (the interval counters, the CPU worker and
when its result is installed), ``GradientScale`` (clip and fp16 loss scale), ``GradExchange``
(data parallel). ``step()`` reads as its phases: exchange, coefficient, selection, device
update, host update, boundary; the host side's phases are functions of this facade
(zfctl/offload/cpu/phases.py).

Choices the algorithm leaves open (dense params always on the device, a missing ``.grad`` stepped
as zeros, one parameter group, a skipped fp16 step is no step) are listed in docs/design.md,
"Algorithm". ``vocab_params`` names the token-indexed matrices (``vocab_matrices(model)``), split
by row under ``zenflow.vocab_select: rows``. With a ``process_group`` of several ranks, ``step()``
first averages the gradients where they are read (do not also wrap the model in DDP). With a
``shard_group`` instead, the parameters are FSDP2 shards and the optimizer steps its local rows
(sharded.py: FSDP2 has already averaged the gradients; scores and norms are summed over the group;
the hook path takes each layer's shards from FSDP2's hooks once it has reduced them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import torch
from typing_extensions import Self

from zfctl.offload import state
from zfctl.offload.columns.selector import Selector
from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.cpu import phases
from zfctl.offload.cpu.auto_interval import IntervalPolicy
from zfctl.offload.cpu.host import HostState
from zfctl.offload.cpu.pipeline import Pipeline
from zfctl.offload.device.device_adam import DeviceAdam
from zfctl.offload.device.install import Installer
from zfctl.offload.device.pcie import count_waits
from zfctl.offload.grads.device_to_host import (
    DuringBackward,
    GradientPath,
    NoHostColumns,
    Transfers,
    build_host_side,
)
from zfctl.offload.grads.release import GradRelease, build_release, regather_pairs
from zfctl.offload.grads.scaler import DynamicLossScaler, GradientScale
from zfctl.offload.layout import named_params, plan_layout
from zfctl.offload.ledger import Ledger
from zfctl.offload.parallel.exchange import GradExchange
from zfctl.offload.parallel.partition import Partition, group_info, partition_layout
from zfctl.offload.parallel.pieces import owned_ranges
from zfctl.offload.parallel.sharded import ShardedParams
from zfctl.offload.stats import DeviceClock, StepStats


class ZenFlowOptimizer(torch.optim.Optimizer):
    """AdamW with ZenFlow offload. See the module docstring and docs/design.md, "Algorithm"."""

    def __init__(self, params: Iterable[Any], config: ZenFlowConfig | None = None, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float | None = None, loss_scaling: bool | None = None,
                 steps_per_epoch: int | None = None, process_group: Any = None,
                 vocab_params: Iterable[str] = (), shard_group: Any = None) -> None:
        config = (config if config is not None else ZenFlowConfig()).validate()
        named = named_params(params)
        vocab = set(vocab_params)  # matrices indexed by token: split by row under vocab_select: rows
        if unknown := vocab - {n for n, _ in named}:
            raise ValueError(f"vocab_params names no trainable parameter: {sorted(unknown)}")
        by_row = frozenset(vocab if config.vocab_select == "rows" else ())
        self._constructing = True
        # The groups hold what the caller passed (DTensors under FSDP2): zero_grad clears their grads.
        super().__init__([p for _, p in named], {"lr": lr, "betas": tuple(betas), "eps": eps,
                                                 "weight_decay": weight_decay})
        self._constructing = False
        self.sharded: ShardedParams | None = None
        if shard_group is not None:  # FSDP2: the engine plans and steps the local shards (sharded.py)
            if process_group is not None:
                raise ValueError("give process_group (zero2) or shard_group (fsdp), not both")
            self.sharded = ShardedParams(named, shard_group, by_row)
            named = self.sharded.local
        self.config, self.names, self.params = config, [n for n, _ in named], [p for _, p in named]
        self.device = self.params[0].device
        fp16 = any(p.dtype == torch.float16 for p in self.params)
        self.scaler = DynamicLossScaler() if (fp16 if loss_scaling is None else loss_scaling) else None
        self.scale = GradientScale(max_grad_norm, self.scaler, self.device)
        self.layout = plan_layout(named, config.topk_ratio, by_row)
        self.rank, self.world_size = group_info(process_group)
        self.partition: Partition | None = None
        if self.world_size > 1:  # this rank's host columns only; device offsets are unchanged
            self.layout, self.partition = partition_layout(self.layout, process_group, self.rank, self.world_size)
        self.device_state = DeviceAdam(self.layout, self.params, self.device)
        self.policy = IntervalPolicy(config.update_interval, auto_ratio=config.tuning.auto_ratio,
                                     min_interval=config.tuning.auto_min_interval, max_interval=config.tuning.auto_max_interval)
        self.exchange: GradExchange | None = None
        if self.partition is not None:  # who receives which gradient columns (exchange.py)
            self.exchange = GradExchange(self.partition, self.layout, self.params, self.device_state.index, self.device,
                                         norm=self.scale.needs_norm, masses=self.policy.auto)
        self.selector = Selector(self.layout, self.device_state, config, steps_per_epoch=steps_per_epoch,
                                 part=self.partition, exchange=self.exchange, sharded=self.sharded)
        self.host: HostState | None = None
        self.transfers: Transfers | None = None
        self.gradient_path: GradientPath = NoHostColumns()  # replaced below when there are host columns
        self.lands_early = True  # False: no backward is announced as final (carry.py, loss scaling)
        self.accumulate = "host"  # resolved zenflow.accumulate
        self.threads: int | None = None  # native threads of the CPU update
        # zenflow.tuning.release_grads (release.py): not under update_interval: auto, whose rule
        # reads every step's per-matrix gradient masses from .grad in step(), nor on FSDP2 shards,
        # whose gradients arrive by FSDP2's reduce-scatter into the sharded params (sharded.py).
        release = config.tuning.release_grads and not self.policy.auto and self.sharded is None
        self.ledger = Ledger()  # each step's bytes and waits, counted where they happen (StepStats.bytes/waits)
        if self.layout.host_slots:
            # The hooks are the stream's own unless release.py's (release) or FSDP2's (shards) call it.
            scaler = self.scaler
            side = build_host_side(self.layout, self.params, self.device, config, exchange=self.exchange,
                                   hooks=self.sharded is None and not release, ledger=self.ledger,
                                   unscale=(lambda: 1.0 / scaler.scale) if scaler is not None else None)
            self.host, self.transfers, self.gradient_path = side.host, side.transfers, side.path
            self.lands_early = side.lands_early
            self.accumulate, self.threads = side.accumulate, side.threads
            if self.sharded is not None and isinstance(self.gradient_path, DuringBackward):
                # The hook path on FSDP2 shards: autograd never accumulates into the local shards,
                # FSDP2 calls the DTensors' hooks once it has reduced each layer (sharded.py).
                self.sharded.hook_grads([s.index for s in self.layout.host_slots], self._shard_reduced)
        self._hook_warned = False  # _check_hooks
        self.release = build_release(self, release)
        self.pipeline = Pipeline(self.host, self.policy, overlap=config.overlap_step,
                                 install=lambda stats: phases.install(self, stats), lag=config.tuning.install_lag,
                                 device=self.device, update_threads=self.threads or 0)
        self.installer = Installer(self.device)  # the install stream and its per-module events
        for part in (self.pipeline, self.pipeline.worker, self.selector, self.installer):
            if part is not None:
                part.ledger = self.ledger
        self._closed = False
        self.last_stats: StepStats | None = None

    def _shard_reduced(self, index: int) -> None:
        """FSDP2 has reduced param ``index``'s gradient shard (sharded.py ``hook_grads``): on the
        announced last backward, the hook path lands its host columns now, as zero2's hooks do."""
        assert self.sharded is not None and isinstance(self.gradient_path, DuringBackward)
        stream = self.gradient_path.stream
        if stream.armed:
            self.sharded.pull_grad(index)
            stream.on_grad(index, self.params[index])

    def _check_hooks(self, stats: StepStats) -> None:
        """FSDP2 shards, an announced last backward: warn once if no gradient hook fired (a torch
        whose FSDP2 does not call the sharded parameters' post-accumulate-grad hooks). The
        results are the same (step() lands what no hook did); only the overlap is lost."""
        if stats.early_chunks or not stats.in_step_chunks or self._hook_warned:
            return
        self._hook_warned = True
        import warnings

        warnings.warn("the hook path under FSDP2: no gradient reached the host during backward "
                      f"(torch {torch.__version__} did not run the sharded parameters' post-accumulate-grad "
                      "hooks); step() moves them instead", RuntimeWarning, stacklevel=3)

    # -- the loop's calls ---------------------------------------------------------------------
    def attach_install_waits(self, model: torch.nn.Module) -> int:
        """Each module's forward waits only for its own params' install (install.py); returns the
        modules hooked. One process only: FSDP2's all-gathers and zero2's broadcast read the params
        outside the modules' forwards, so there the compute stream waits for the whole install."""
        if self.host is None or self.sharded is not None or self.exchange is not None:
            return 0
        return self.installer.attach(model.modules(), self.params, [s.index for s in self.layout.host_slots])

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` for fp16 (dynamic scaling), the loss itself otherwise."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def prepare_backward(self, final: bool = True) -> None:
        """Announce the next backward: ``final=True`` if it is the last of this optimizer step (its
        gradients are then final and may leave for the host during it, device_to_host.py); False
        for earlier micro-batches. Optional: without it, step() moves the gradients itself."""
        final = final and self.lands_early  # the carry layout under loss scaling: step() lands (carry.py)
        due = self.selector.due(self.pipeline.t)
        # A selection reads the whole .grad on the step() path; the release path keeps the column
        # scores it needs in the hooks instead, on one process (the ranks' scores are all-reduced
        # from .grad) and at an interval's first step (regather reads the step's own slot).
        released = self.release is not None and (not due or (self.exchange is None and
                                                              self.pipeline.first_of_interval))
        final = final and (not due or released)
        if self.release is not None:
            if final and released:
                self.release.arm(self.selector.selected, scoring=due)
            else:
                self.release.disarm()
        if self.host is None:
            return
        self.gradient_path.begin(final=final, slot=self.pipeline.slot() if final else None)

    @torch.no_grad()
    def step(self, closure: Any = None) -> StepStats:  # type: ignore[override]
        """One ZenFlow step over the current ``.grad``s; returns (and keeps) its ``StepStats``."""
        if self._closed:
            raise RuntimeError("ZenFlowOptimizer is closed")
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.last_stats is not None:
            self.last_stats.resolve()  # the previous step's device timings: long finished, no wait
        t, hp = self.pipeline.t, self._hyper()
        warm = t < self.selector.warmup
        # The step's ledger tab opened when the last step closed: its backward's hooks are in it.
        stats = StepStats(step=t, warmup=warm, loss_scale=self.scaler.scale if self.scaler else None,
                          d2h_gbps=self.gradient_path.d2h_gbps, tab=self.ledger.tab())
        # The forward's waits for its layers (install.py); then the device update.
        count_waits(stats, self.installer.wait_all(), "device.install")
        sq, totals = self._exchange_gradients(stats, warm)  # 0. data parallel: average where read
        streamed = False  # FSDP2 shards: the hook path was armed for the backward just done
        if self.sharded is not None:  # FSDP2 averaged them already: read the local shards
            self.sharded.pull_grads()
            path = self.gradient_path
            streamed = isinstance(path, DuringBackward) and path.stream.armed
        grads = [p.grad for p in self.params]  # None where a hook released it (release.py)
        if self.sharded is not None and self.scale.needs_norm:  # the global norm: one all-reduce
            sq = self.sharded.sum_of_squares(grads, self.device)
        released = self.release if self.release is not None and self.release.armed else None
        norms = released.norms if released is not None else None
        norm, coef, clip = self.scale.coefficient(grads, sq, norms)  # 1. clip factor, loss scale: on the device
        if self.scale.overflowed(norm):  # fp16: skip the whole step (a host sync, fp16 only)
            self.gradient_path.skip(stats)  # its slot is not recorded: the next step rewrites it
            self._disarm()
            stats.skipped, stats.grad_norm = True, math.inf
            self.ledger.close()
            self.last_stats = stats
            return stats
        if self.selector.due(t):  # 2. selection: choose, the entering part of the update in flight, migrate
            totals = self._reselect(grads, stats, released)
        scalars = phases.start_scalars(self, norm, clip, grads, warm, totals) if self.host is not None else None
        clock = DeviceClock(self.device)  # 3. device AdamW (+ the device path's sum)
        self.device_state.load_grads(self.params, coef, self.selector.selected,
                                     loaded=released.loaded if released is not None else frozenset())
        self.device_state.step(**hp, selected=self.selector.selected)
        self.device_state.write_params(self.params, self.selector.selected)
        # The device path's interval sum takes the unscale only: the clip factors come at the
        # boundary, as their interval mean (the interval-mean rule, phases.py ``boundary``).
        self.gradient_path.add_device(grads, self._unscale_tensor(), first=self.pipeline.first_of_interval,
                                      stats=stats)
        clock.stop(stats)
        self.selector.land()  # release: a selection's leaving gradient columns into the step's slot
        tail, host_norm = time.perf_counter(), None
        if scalars is not None:  # 4-6. the rest of the gradient, and the boundary
            host_norm, tail = phases.host_update(self, scalars, grads, warm, hp, stats)
        self._finish(stats, norm, host_norm, tail)
        if self.sharded is not None:
            self.sharded.release_grads()
            if streamed:
                self._check_hooks(stats)
        self._disarm()
        return stats

    def _unscale_tensor(self) -> torch.Tensor | None:
        """``u`` as a 0-dim device tensor for the device path's sum (fp16), None where it is 1.0
        (the sum then adds the gradient as it is: ``fma(g, 1, a)``). A fill kernel, no sync."""
        u = self.scale.unscale
        return None if u == 1.0 else torch.full((), u, dtype=torch.float32, device=self.device)

    def _disarm(self) -> None:
        if self.release is not None:
            self.release.disarm()

    def flush(self) -> None:
        """Wait for an in-flight CPU update and install it now (end of training, before export)."""
        if self.host is not None:
            stats = StepStats(step=self.pipeline.t)
            with self.ledger.charging(stats.tab):  # no step's bytes: the flush's own
                self.drain()
                self.pipeline.collect(stats)
            self.installer.wait_all()  # whoever reads the params next, on the compute stream

    def drain(self) -> None:
        """Wait until no gradient copy into a slot (host paths) or sum copy (device path) runs."""
        self.gradient_path.drain()

    def close(self) -> None:
        """Stop the CPU worker (after finishing its update, not installed) and let no copy run on
        into memory that is about to be freed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.release is not None:
            self.release.close()
        if self.sharded is not None:
            self.sharded.close()
        self.gradient_path.close()  # waits for the copies into the slots
        self.installer.close()  # the hooks off; the params' next reader comes after the last install
        self.drain()  # a copy out may still write the host sum
        self.pipeline.close()  # the worker wrote the last selection's leaving state from the staging
        self.selector.release()  # waits for the staging's last H2D, then unpins it
        if self.host is not None:
            self.host.wait_install()  # the last install's DMA may still read the master
            self.host.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_param_group(self, param_group: dict) -> None:
        """Only the construction's single group: ZenFlow plans its buffers for a fixed set of params."""
        if not getattr(self, "_constructing", False):
            raise NotImplementedError("ZenFlowOptimizer takes all its parameters at construction")
        super().add_param_group(param_group)

    # -- step phases --------------------------------------------------------------------------
    def _hyper(self) -> dict[str, float]:
        g = self.param_groups[0]
        return {"lr": g["lr"], "beta1": g["betas"][0], "beta2": g["betas"][1], "eps": g["eps"],
                "weight_decay": g["weight_decay"]}

    def _exchange_gradients(self, stats: StepStats, warm: bool) -> tuple[torch.Tensor | None, list | None]:
        """Data parallel (exchange.py): every gradient averaged to the ranks that read it."""
        if self.exchange is None:
            return None, None
        masses = self.policy.auto and self.selector.selected and not warm
        return self.exchange.average(self.gradient_path.exchanged(), self.selector, stats, masses=masses)

    def _reselect(self, grads: list[torch.Tensor | None], stats: StepStats,
                  released: GradRelease | None) -> list[torch.Tensor] | None:
        """2. selection, no drain: the update in flight updates the entering columns first (selector.py)."""
        assert self.host is not None and self.transfers is not None  # a selectable matrix has host columns
        c = time.perf_counter()
        # The migration's streams follow the compute stream, which waited for the last install (wait_all above).
        extra = None
        if released is not None:  # the released gradients follow the new selection (release.py)
            self.gradient_path.drain()  # sync point: the hooks' copies into the slot the moves read
            slot = self.pipeline.slot()
            assert slot is not None  # a host path: a released selection is the interval's first step
            extra = regather_pairs(released.loaded, slot)
        totals = self.selector.select(grads, self.host, stats, pipeline=self.pipeline,
                                      scores=released.scores if released else None, extra=extra)
        self.transfers.replan()  # while the worker fills the in ring
        if released is not None:
            assert isinstance(self.gradient_path, DuringBackward)  # the only host path with release
            self.gradient_path.stream.replan(self.transfers.chunks)
        self.selector.arrive()  # the entering state: its fill waited for, the compute stream after it
        stats.selection = True
        stats.stall_ms += (time.perf_counter() - c) * 1e3  # the ids, the entering part, the enqueueing
        return totals

    def _finish(self, stats: StepStats, norm: torch.Tensor | None, host_norm: float | None, tail: float) -> None:
        stats.set_grad_norm(host_norm, norm, cuda=self.device.type == "cuda")
        if self.host is not None:  # writes that waited for the CPU update to read a slot (acc_gate.py)
            stats.acc_gate_waits, stats.acc_gate_ms = self.host.gate.take_counts()
        stats.stall_ms += (time.perf_counter() - tail) * 1e3
        self.scale.step_done()
        stats.update_interval = self.pipeline.last_interval
        stats.selected_fraction = self.selector.selected_fraction()
        self.pipeline.advance()
        self.ledger.close()  # the next step's tab opens: the next backward's hooks count into it
        self.last_stats = stats

    # -- checkpoints (state.py) ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically (an in-flight update is waited for
        first). Like ``torch.optim``, the live state, not copies (state.py); the host state as
        pieces keyed by parameter name and column range, loadable on any world size (pieces.py).
        Under FSDP2 (``shard_group``) the state of this rank's rows, marked with its place in the
        group: it loads into the same rank of the same world size only."""
        return self._state(stream=False)

    def checkpoint_state(self) -> dict[str, Any]:
        """``state_dict()`` for a checkpoint written at once (zfctl/train/tensorfile.py): the host
        paths' unfinished interval sum is formed chunk by chunk as the writer reads it, so the
        save holds no buffer of it (state.py, cpu/partial.py). Valid until the next ``step()``."""
        return self._state(stream=True)

    def _state(self, *, stream: bool) -> dict[str, Any]:
        self.installer.wait_all()  # a checkpoint reads the params next
        return state.save(self, stream=stream)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict`` of an optimizer over the same parameters and topk_ratio; data
        parallel: its host pieces, from any world size, must cover this rank's columns. FSDP2: a
        state of the same rank and world size (``state_dict``; state.py ``load``)."""
        self.installer.wait_all()  # the load writes the device master an install's restore reads
        state.load(self, state_dict)

    def host_ranges(self) -> list[tuple[str, int, int]]:
        """(name, c0, c1) of the host column ranges this optimizer holds: what a resharding resume
        must find in the saved pieces (pieces.py)."""
        return owned_ranges(self.layout)

    def partition_info(self) -> dict[str, Any]:
        """Which share of the host state this optimizer holds, and every rank's pieces (state.py)."""
        return state.partition_info(self.layout, self.partition)
