"""ZenFlowOptimizer: AdamW split between the device (important columns) and the CPU (the rest).

Per step t (``W`` = full_warm_up_rounds, ``U`` = update_interval), ``step()`` does, in order:

1. One gradient coefficient on the device: clip factor ``min(1, max_norm / (norm + 1e-6))``
   (torch.nn.utils.clip_grad_norm_'s formula, global L2 norm over every gradient) divided by the
   fp16 loss scale. Both paths multiply by it. fp16 overflow (non-finite norm) skips the whole
   step, device and host, and halves the scale: the only per-step host sync, fp16 only.
2. Selection, at ``t == W`` and then every select period: the CPU pipeline drains first (any
   in-flight update is waited for and installed), then each matrix keeps its top-k columns by
   gradient L1 and the state of entering/leaving columns migrates (``selection.migrate``).
3. Device AdamW on the dense params and the selected columns (``device_adam``), written back
   into the model params.
4. The other columns' gradients are accumulated in fp32, ``acc += coef * grad``, by one of three
   paths with the same result: ``step()`` streams them to the host and accumulates them itself
   (``chunks.offload_gradients``); or, when the loop announced the step's last backward
   (``prepare_backward``), they already left during that backward and a host thread adds them
   (``stream``, bit-identical); or, with ``accumulate: device``, they are added on the device and
   only the interval sum crosses PCIe at the boundary (``device_acc``, within an ulp per step).
   The interval counters, the accumulators and the CPU worker belong to ``pipeline.Pipeline``.
5. At a boundary (every ``U`` steps, or the auto rule, or the step before a re-selection, or every
   warm-up step) the CPU worker runs AdamW on the host-owned columns with the interval-mean
   gradient (``grad_scale = 1/steps accumulated``), with the learning rate of the boundary step
   (times ``zenflow.deferred_lr_scale``'s factor for the steps it stood for, or, with ``repeat``,
   as that many AdamW steps with the same mean gradient; see ``correction``).
   Without ``overlap_step`` (and during warm-up) the step waits for it and installs the result
   (H2D into the model params) at once. With it, the update runs in the background and is
   installed at the next boundary, before the next one is submitted: the non-selected columns are
   exactly one interval stale, and which values land when depends only on step counts, never on
   thread timing. At a re-selection the drain installs the last update one step (instead of one
   interval) after its submission; that is the only place the staleness differs.
   ``zenflow.tuning.install_lag: L`` installs it at the end of the L-th step after its boundary instead
   (``pipeline.install_due``; the step waits if it is not done).

Choices the algorithm leaves open, made here:

* Dense (0-D/1-D) params are updated on the device every step, warm-up included (they have no
  host state; for them warm-up and steady state are the same AdamW). ``full_warm_up_rounds``
  therefore means "matrices fully through the CPU". With ``topk_ratio == 1`` nothing is offloaded
  and warm-up has no effect; with ``topk_ratio == 0`` matrices never get device columns.
* A parameter whose ``.grad`` is None in some step is stepped with a zero gradient (its moments
  decay, weight decay applies); torch.optim.AdamW would skip it. Frozen parameters
  (``requires_grad=False``) are left out at construction.
* One parameter group (lr, betas, eps, weight_decay); an LR scheduler drives ``param_groups[0]``.
* A skipped fp16 step does not count as a step: counters, intervals and selection do not move.
* ``vocab_params``: names of the token-indexed matrices (``layout.vocab_matrices(model)``). Under
  ``zenflow.vocab_select: rows`` they choose rows (tokens) instead of columns (layout.py, by-row
  slots); under ``columns`` the names change nothing.
* ``process_group`` (more than one rank): ``step()`` first averages the ``.grad``s over the group
  where they are read (do not wrap the model in DDP as well): the replicated ones on every rank,
  each host column on its owner only (``exchange``); the device half of the state is replicated
  and the host half partitioned by column ranges; see ``partition`` for the scheme and its traffic.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from typing_extensions import Self

from zfctl.errors import ConfigError
from zfctl.offload.auto_interval import IntervalPolicy
from zfctl.offload.bandwidth import inflight_bytes, measure_d2h_gbps
from zfctl.offload.checkpoint import check_state, pack_state, unpack_state
from zfctl.offload.chunks import install_params, offload_gradients, plan_chunks
from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.correction import corrected_hyperparams, inner_steps
from zfctl.offload.device_acc import DeviceAccumulator, resolve
from zfctl.offload.device_adam import DeviceAdam
from zfctl.offload.exchange import GradExchange
from zfctl.offload.host import HostState
from zfctl.offload.layout import as_matrix, plan_layout
from zfctl.offload.partition import OwnedRows, Partition, group_info, partition_layout
from zfctl.offload.pcie import waited_ms
from zfctl.offload.pipeline import Pipeline
from zfctl.offload.reshard import check_covers, gather_host, owned_ranges, split_host
from zfctl.offload.ring import Ring, ring_slot_bytes
from zfctl.offload.scaler import DynamicLossScaler
from zfctl.offload.selection import HostRows, column_l1, migrate, top_columns
from zfctl.offload.stats import StepStats
from zfctl.offload.stream import GradStream
from zfctl.offload.threads import capped, split_threads
from zfctl.offload.worker import CpuUpdate


class ZenFlowOptimizer(torch.optim.Optimizer):
    """AdamW with ZenFlow offload. See the module docstring for the exact per-step semantics."""

    def __init__(self, params: Iterable[Any], config: ZenFlowConfig | None = None, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float | None = None, loss_scaling: bool | None = None,
                 steps_per_epoch: int | None = None, process_group: Any = None,
                 vocab_params: Iterable[str] = ()) -> None:
        config = ZenFlowConfig() if config is None else config  # the defaults: the `default` preset
        config.validate()
        named = _named_params(params)
        # Matrices indexed by token (``vocab_matrices(model)``): split by row under vocab_select: rows.
        vocab = set(vocab_params)
        if unknown := vocab - {n for n, _ in named}:
            raise ValueError(f"vocab_params names no trainable parameter: {sorted(unknown)}")
        by_row = frozenset(vocab if config.vocab_select == "rows" else ())
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self._constructing = True
        super().__init__([p for _, p in named], defaults)
        self._constructing = False
        self.config = config
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.device = self._params[0].device
        self.max_grad_norm = max_grad_norm
        self.process_group = process_group
        fp16 = any(p.dtype == torch.float16 for p in self._params)
        self._scaler = DynamicLossScaler() if (fp16 if loss_scaling is None else loss_scaling) else None

        self.layout = plan_layout(named, config.topk_ratio, by_row)
        self.rank, self.world_size = group_info(process_group)
        self._part: Partition | None = None
        if self.world_size > 1:  # this rank's host columns only; device offsets are unchanged
            self.layout, self._part = partition_layout(self.layout, process_group, self.rank, self.world_size)
        self._device = DeviceAdam(self.layout, self._params, self.device)
        self._selectable = [s for s in self.layout.slots if s.selects]
        self._selected = not self._selectable  # nothing to choose: every device column is fixed
        self._host_slots = self.layout.host_slots
        self._warmup = config.full_warm_up_rounds if self._host_slots else 0
        self._period = config.select_period(steps_per_epoch) if self._selectable else None
        self._policy = IntervalPolicy(config.update_interval, auto_ratio=config.tuning.auto_ratio,
                                      min_interval=config.tuning.auto_min_interval,
                                      max_interval=config.tuning.auto_max_interval)
        self._exchange: GradExchange | None = None
        if self._part is not None:  # who receives which gradient columns (exchange.py)
            self._exchange = GradExchange(self._part, self.layout, self._params, self._device.index, self.device,
                                          norm=self._needs_norm, masses=self._policy.auto)
        self.host: HostState | None = None
        self._dev_acc: DeviceAccumulator | None = None
        self.accumulate = "host"  # resolved zenflow.accumulate (host when nothing is offloaded)
        self.threads: tuple[int, int] | None = None  # (accumulation, update) native threads
        if self._host_slots:
            self._setup_host()
        # Counters, accumulators, the CPU worker and the one-update-in-flight rule (pipeline.py).
        self.pipeline = Pipeline(self.host, self._policy, overlap=config.overlap_step, install=self._install,
                                 lag=config.tuning.install_lag, device=self.device)
        self._stream: GradStream | None = None
        self.d2h_gbps: float | None = None  # measured by _make_stream on CUDA (bandwidth.py)
        # The hook path's accumulation the next CPU update must wait for.
        self._fence: Callable[[], Any] | None = None
        if self.pipeline.worker is not None:
            native = self.pipeline.worker.native
            if config.cpu_threads:
                native.set_num_threads(config.cpu_threads)
            # Accumulation and the in-flight update share the cores (threads.py); without overlap
            # the update runs alone while step() waits, so it takes them all.
            self.threads = split_threads(native.get_num_threads(), config.tuning.accumulate_threads)
            self.pipeline.worker.threads = self.threads[1] if config.overlap_step else 0
            self._accumulate = capped(native, self.threads[0])
            if config.tuning.stream_grads and self._dev_acc is None:
                self._stream = self._make_stream()
        self._closed = False
        self.last_stats: StepStats | None = None

    def _setup_host(self) -> None:
        """Host buffers, the CPU worker and the two transfer rings (r < 1 only)."""
        dtypes = {self._params[s.index].dtype for s in self._host_slots}
        if len(dtypes) > 1:
            raise ValueError(f"offloaded weights must share one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        itemsize = dtype.itemsize
        self.accumulate = resolve(self.config.accumulate, self.device, 4 * self.layout.host_numel)
        on_device = self.accumulate == "device"
        cuda_pin = self.device.type == "cuda" and self.config.tuning.pin_memory
        # Two accumulators only where the next interval is summed on the host while the worker reads
        # the last one (overlap, host paths); the device path sums on the device and lands the sum
        # in its one host accumulator after the previous update was collected (_boundary).
        self.host = HostState(self.layout, self._params,
                              accumulators=2 if self.config.overlap_step and not on_device else 1,
                              pin_master=cuda_pin, pin_acc=cuda_pin and on_device)
        if on_device:
            self._dev_acc = DeviceAccumulator(self.layout, self.device)
        biggest = max(self._host_slots, key=lambda s: s.rows)
        want = int(self.config.tuning.ring_slot_mb * 2**20)
        if biggest.rows * itemsize > want:
            need = biggest.rows * itemsize / 2**20
            raise ConfigError("zenflow.tuning.ring_slot_mb", self.config.tuning.ring_slot_mb,
                              f"one column of {biggest.name!r} is {need:.3f} MiB; use at least that")
        slot_bytes = ring_slot_bytes(want, self.config.tuning.ring_slots, biggest.rows, self.layout.host_numel, itemsize)
        pin = self.config.tuning.pin_memory
        # D2H: model-dtype gradient chunks (step() path, scalars). H2D: the same column ranges of the
        # fp32 master, 4/itemsize times the bytes; on CUDA with a page-locked master they DMA
        # straight from it (no host slots), else they stage through host slots.
        self._d2h = Ring(self.device, self.config.tuning.ring_slots, slot_bytes, pin)
        self._h2d = Ring(self.device, self.config.tuning.ring_slots, slot_bytes * 4 // itemsize, pin,
                         host_slots=self.device.type == "cuda" and not cuda_pin)
        self._itemsize = itemsize
        self._refresh_chunks()

    def _make_stream(self) -> GradStream:
        """The hook path (stream.py): a landing buffer pair and the accumulation thread."""
        dtype = self._params[self._host_slots[0].index].dtype
        # Device temporaries in flight: what the link drains in ~2 ms at the rate measured once
        # here (bandwidth.py; a sync, at construction only), or zenflow.tuning.inflight_mb when set. Off
        # CUDA there is no link to measure: 4x the ring, as before. Never more than the host-path
        # gradient itself.
        self.d2h_gbps = measure_d2h_gbps(self.device)  # a sync, once
        if self.config.tuning.inflight_mb:
            budget = int(self.config.tuning.inflight_mb * 2**20)
        elif self.d2h_gbps is not None:
            budget = inflight_bytes(self.d2h_gbps)
        else:
            budget = 4 * self.config.tuning.ring_slots * self._d2h.slot_bytes
        budget = min(budget, self.layout.host_numel * self._itemsize)
        return GradStream(self._params, self._host_slots, numel=self.layout.host_numel, dtype=dtype,
                          device=self.device, pin_memory=self.config.tuning.pin_memory, budget_bytes=max(budget, 1),
                          accumulate=self._accumulate, exchange=self._exchange)

    def _refresh_chunks(self) -> None:
        """Re-plan the column chunks after the device-owned columns changed."""
        assert self.host is not None  # only the host path has chunks
        self._chunks = plan_chunks(self.layout, self.host.device_owned, self._d2h.slot_bytes, self._itemsize)
        # Host-owned elements the accumulation and the CPU update touch (for StepStats.host_bytes).
        self._host_elems = sum(ch.numel if ch.runs is None else int(ch.runs[:, 1].sum()) for ch in self._chunks)

    # -- the public loop API ------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` for fp16 (dynamic scaling), the loss itself otherwise."""
        return loss * self._scaler.scale if self._scaler is not None else loss

    def prepare_backward(self, final: bool = True) -> None:
        """Announce the next backward: ``final=True`` if it is the last of this optimizer step
        (its gradients are then final and leave for the host during it, see stream.py); False
        for the earlier micro-batches of a gradient-accumulation window. Optional: without it,
        step() moves the gradients itself. Call ``step()`` after that backward."""
        if self._stream is None:
            return
        t = self.pipeline.t
        if not final or self._selection_due(t):  # a selection re-plans the chunks: step() path
            self._stream.disarm()
            return
        known = 1.0 if self.max_grad_norm is None and self._scaler is None else None
        self._stream.arm(self._chunks, self.pipeline.acc, known, first=self.pipeline.first_of_interval)

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
        t, group = self.pipeline.t, self.param_groups[0]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        warm = t < self._warmup
        stats = StepStats(step=t, warmup=warm, loss_scale=self._scaler.scale if self._scaler else None,
                          d2h_gbps=self.d2h_gbps)
        # The armed gradient stream when the hooks moved this step's gradients, else None.
        streamed = self._stream if self._stream is not None and self._stream.armed else None
        sq: torch.Tensor | None = None
        totals: list[torch.Tensor] | None = None
        if self._exchange is not None:
            # 0. Data parallel: the replicated gradients all-reduced, each host column reduced to
            #    its owner only (collectives; the gradient hooks already exchanged the matrices
            #    they streamed). The norm and the auto-interval masses need the owners' partials.
            done = streamed.complete_exchanges() if streamed else set()
            want_masses = self._policy.auto and self._selected and not warm
            red = self._exchange.reduce(done, masses=want_masses)
            stats.comm_bytes += red.sent
            sq = red.sq
            if red.host_mass is not None:
                totals = self._mass_totals(red.host_mass)
        grads = [p.grad for p in self._params]

        # 1. The gradient coefficient (device tensors; the fp16 overflow check is a sync point).
        norm, coef = self._coefficient(grads, sq)
        # (norm is None only without a loss scaler and clipping, see _coefficient)
        if self._scaler is not None and norm is not None and not bool(torch.isfinite(norm).item()):
            self._scaler.update(overflow=True)
            if streamed:
                streamed.finish(stats, None, self._itemsize)  # drop what the hooks moved
            stats.skipped, stats.grad_norm = True, math.inf
            self.last_stats = stats
            return stats

        # 2. Selection: drain the CPU pipeline, choose columns, migrate their state.
        if self._selection_due(t):
            c = time.perf_counter()
            self._collect(stats)
            totals = self._select(grads, stats)
            stats.selection = True
            stats.stall_ms += (time.perf_counter() - c) * 1e3  # host-driven migration: the device waits

        # Host scalars start their D2H now, ordered before the device update below.
        scalars = self._start_scalars(norm, coef, grads, warm, totals) if self.host is not None else None

        # 3. Device AdamW on the dense params and selected columns.
        t0 = _Clock(self.device)
        self._device.load_grads(self._params, coef, self._selected)
        self._device.step(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, selected=self._selected)
        self._device.write_params(self._params, self._selected)
        if self._dev_acc is not None:  # accumulate=device: the rest of the gradient, summed here too
            self._dev_acc.add(grads, coef, first=self.pipeline.first_of_interval)
            _count_device_waits(stats, self._dev_acc.stall_pairs)  # waits for last interval's copy out
        t0.stop(stats)

        tail = time.perf_counter()
        host_norm = None
        if self.host is not None:
            # 4. The rest of the gradient goes to the host and is accumulated in fp32.
            assert scalars is not None  # started above: there are host columns
            values = scalars().tolist()  # sync point: waits for the norm/coef/masses only
            host_norm, host_coef, masses = values[0], values[1], values[2:]
            # Not stall: the device update is queued behind the scalars, the device keeps busy.
            # Everything from here on is host work the device does not overlap with: stall.
            tail = c = time.perf_counter()
            if self._dev_acc is not None:
                pass  # added on the device above; crosses PCIe only at the boundary
            else:
                first = self.pipeline.first_of_interval
                # Host memory per element: read the gradient, write acc (and read it after the first).
                stats.host_bytes += self._host_elems * (self._itemsize + (4 if first else 8))
                if streamed:  # the hooks moved it during backward; the host thread adds it
                    fence = streamed.finish(stats, host_coef, self._itemsize)
                    self._fence = fence.result if fence is not None else None
                    stats.d2h_bytes += stats.early_bytes
                else:
                    if self._stream is not None:
                        self._stream.drain()  # the thread may still add the previous step into acc
                    stats.d2h_bytes += offload_gradients(self._d2h, self._chunks, grads, self.pipeline.acc,
                                                         host_coef, self._accumulate, overwrite=first)
                    stats.in_step_chunks = len(self._chunks)
                    stats.in_step_bytes = sum(ch.numel for ch in self._chunks) * self._itemsize
            stats.d2h_bytes += 4 * len(values)
            stats.offload_ms = (time.perf_counter() - c) * 1e3
            # 5. zenflow.tuning.install_lag: the last boundary's update lands now (waiting for it: stall).
            if self.pipeline.install_due():
                self._collect(stats)
            # 6. Boundary: hand the interval to the CPU worker.
            if self.pipeline.close_step(force=warm or self._selection_due(t + 1)):
                self._boundary(stats, warm, lr=lr, beta1=beta1, beta2=beta2, eps=eps, wd=wd)
            elif self._policy.auto and self._selected:
                self._observe(masses, host_coef)

        if host_norm is not None:
            stats.grad_norm = host_norm
        elif norm is not None:  # topk 1: nothing synced yet; read the norm one step late on CUDA
            def read_norm(st: StepStats, norm: torch.Tensor = norm) -> None:
                st.grad_norm = float(norm.item())

            stats.defer(read_norm)
            if self.device.type != "cuda":
                stats.resolve()
        stats.stall_ms += (time.perf_counter() - tail) * 1e3
        if self._scaler is not None:
            self._scaler.update(overflow=False)
        stats.update_interval = self.pipeline.last_interval
        stats.selected_fraction = self._selected_fraction()
        self.pipeline.advance()
        self.last_stats = stats
        return stats

    def flush(self) -> None:
        """Wait for an in-flight CPU update and install it now (end of training, before export)."""
        if self.host is not None:
            self._drain()
            self._collect(StepStats(step=self.pipeline.t))

    def close(self) -> None:
        """Stop the CPU worker (after finishing its update, not installed) and let no copy run on
        into memory that is about to be freed. Idempotent."""
        if not self._closed:
            self._closed = True
            if self._stream is not None:
                self._stream.close()  # drains the accumulation thread, waits for its copies
            if self._dev_acc is not None:
                self._dev_acc.wait()  # a copy out may still write the host accumulator
            self.pipeline.close()
            if self.host is not None:
                self.host.wait_install()  # the last install's DMA may still read the master
                self.host.release()
                self._d2h.release()
                self._h2d.release()

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
    @property
    def _needs_norm(self) -> bool:
        """The step needs the global gradient norm (clipping, or the fp16 overflow check)."""
        return self.max_grad_norm is not None or self._scaler is not None

    def _coefficient(self, grads: list[torch.Tensor | None],
                     sq: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(global grad norm, coefficient) as 0-dim fp32 device tensors; (None, None) if not needed.
        ``sq``: the global sum of squares, when the data-parallel exchange assembled it."""
        if not self._needs_norm:
            return None, None
        present = [g for g in grads if g is not None]
        if sq is None and not present:
            zero = torch.zeros((), device=self.device)
            return zero, zero + 1.0
        if sq is not None:
            norm = sq.sqrt()
        else:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(present, 2.0, dtype=torch.float32)))
        coef = torch.ones((), device=self.device)
        if self._scaler is not None:
            norm = norm / self._scaler.scale  # the unscaled norm
            coef = coef / self._scaler.scale
        if self.max_grad_norm is not None:
            coef = coef * torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        return norm, coef

    def _selection_due(self, t: int) -> bool:
        """Selection happens at t == W and every select period after it."""
        if not self._selectable or t < self._warmup:
            return False
        return t == self._warmup or (self._period is not None and (t - self._warmup) % self._period == 0)

    def _select(self, grads: list[torch.Tensor | None], stats: StepStats) -> list[torch.Tensor] | None:
        """Top-k columns per matrix from this step's gradient; state follows the columns.

        Data parallel: the scores come from every owner (one all-reduce), and the gradients of
        the entering columns from their owners; returns each matrix's total L1 mass then (the
        auto interval's input: no rank holds the whole gradient), else None.
        """
        assert self.host is not None  # a selectable matrix has host columns
        self.host.wait_install()  # migration writes the master: the last install's DMA must be done
        old = list(self._device.index)
        shared = None
        if self._exchange is not None:
            shared, sent = self._exchange.scores()
            stats.comm_bytes += sent
        for i, slot in enumerate(self._selectable):
            g = grads[slot.index]
            if shared is not None:
                scores = shared[i]
            else:
                scores = column_l1(as_matrix(g, slot)) if g is not None else torch.zeros(slot.cols, device=self.device)
            new = top_columns(scores, slot.k)
            own = self.host.column_state(slot)
            host: Sequence[HostRows] = own
            owned: list[OwnedRows] = []
            if self._part is not None:  # this rank holds only some rows: owners supply the rest
                owned = [OwnedRows(h, slot.host_c0, slot.host_c1, self.process_group, self.device) for h in own]
                host = tuple(owned)
            d2h, h2d = migrate(self._device.column_state(slot), host, self._device.index[slot.index], new)
            stats.d2h_bytes += d2h
            stats.h2d_bytes += h2d
            stats.comm_bytes += sum(o.sent for o in owned)
            self._device.index[slot.index] = new
            self.host.set_device_owned(slot, new)
        self._selected = True
        self._refresh_chunks()
        if self._exchange is None or shared is None:
            return None
        stats.comm_bytes += self._exchange.share_entering(old)
        return [s.sum() for s in shared]

    def _mass_totals(self, host_mass: torch.Tensor) -> list[torch.Tensor]:
        """Data parallel: each selectable matrix's total gradient L1 mass, the selected columns'
        (replicated) plus the owners' all-reduced host-path mass."""
        totals = []
        for i, slot in enumerate(self._selectable):
            g, idx = self._params[slot.index].grad, self._device.index[slot.index]
            assert g is not None and idx is not None  # the exchange filled .grad; masses follow a selection
            totals.append(column_l1(as_matrix(g, slot).index_select(1, idx)).sum() + host_mass[i])
        return totals

    def _start_scalars(self, norm: torch.Tensor | None, coef: torch.Tensor | None,
                       grads: list[torch.Tensor | None], warm: bool,
                       totals: list[torch.Tensor] | None) -> Callable[[], torch.Tensor]:
        """Start the D2H of [norm, coef, (auto) selected and total L1 mass per matrix]; ``totals``:
        the total masses when only the exchange knows them (data parallel)."""
        one = torch.ones((), device=self.device)
        parts = [norm if norm is not None else one * 0, coef if coef is not None else one]
        if self._policy.auto and self._selected and not warm:
            for i, slot in enumerate(self._selectable):
                g = grads[slot.index]
                if g is None:
                    parts += [one * 0, one * 0]
                    continue
                l1 = column_l1(as_matrix(g, slot))
                parts += [l1[self._device.index[slot.index]].sum(), l1.sum() if totals is None else totals[i]]
        return self._d2h.fetch(torch.stack(parts))

    def _observe(self, masses: list[float], coef: float) -> None:
        """Feed one step's (coefficient-scaled) masses to the auto-interval rule."""
        sel = [m * coef for m in masses[0::2]]
        tot = [m * coef for m in masses[1::2]]
        self._policy.observe(sel, tot, [s.k for s in self._selectable], [s.cols for s in self._selectable])

    def _boundary(self, stats: StepStats, warm: bool, *, lr: float, beta1: float, beta2: float,
                  eps: float, wd: float) -> None:
        """End the interval: submit its CPU update (and, synchronous modes, wait and install it).

        Order on the device path, which has one host accumulator: collect the previous update
        (it may still read that accumulator), then copy this interval's sum into it, then submit
        (Pipeline.submit's ``prepare``).
        """
        assert self.host is not None  # only the host path has intervals
        acc = self.pipeline.acc
        n = self.pipeline.end_interval()
        # The deferred columns stood still for n steps: zenflow.deferred_lr_scale scales this one
        # step for them, or ('repeat') takes n steps (correction.py; 'off' passes lr and wd
        # through untouched and takes one step).
        mode = self.config.deferred_lr_scale
        lr, wd = corrected_hyperparams(mode, n, lr, wd)
        reps = inner_steps(mode, n)
        update = CpuUpdate(acc, 1.0 / n, self.host.update_groups(reps), lr, beta1, beta2, eps, wd, reps)
        # CPU AdamW: master, moments read+written (24 B), acc read (4 B).
        stats.host_bytes += self._host_elems * 28
        prepare = None
        dev_acc = self._dev_acc
        if dev_acc is not None:
            def prepare() -> Callable[[], Any] | None:  # the interval sum crosses PCIe once (fp32)
                stats.d2h_bytes += 4 * self.layout.host_numel
                stats.host_bytes += 4 * self._host_elems
                return dev_acc.copy_out(acc)

        self.pipeline.submit(update, stats, background=self.config.overlap_step and not warm, after=self._fence,
                             prepare=prepare)
        self._fence = None

    def _collect(self, stats: StepStats) -> None:
        """Wait for an in-flight CPU update (stall) and install any finished one into the model."""
        self.pipeline.collect(stats)

    def _drain(self) -> None:
        """Wait for the hook path's queued accumulations (before anyone else reads the accumulator)."""
        if self._stream is not None:
            self._stream.drain()
        if self._dev_acc is not None:
            self._dev_acc.wait()

    def _install(self, stats: StepStats) -> None:
        """Copy the host's finished update into the model params (the pipeline decides when)."""
        assert self.host is not None  # only the host path has updates to install
        nbytes, fence = install_params(self._h2d, self._chunks, self.host.master, self._params)
        stats.h2d_bytes += nbytes
        self.host.install_fence = fence  # the master's next writer waits for the DMA (HostState)
        _count_device_waits(stats, self._h2d.stall_pairs)  # the compute stream waiting for the copies
        # Whole column ranges were written: put the device-owned columns back.
        self._device.write_params(self._params, self._selected, only=self._selectable)
        if self._exchange is not None:  # each owner's columns to every rank (collectives)
            stats.comm_bytes += self._exchange.share_installed()

    def _selected_fraction(self) -> float:
        mats = self.layout.matrices
        total = sum(s.rows * s.cols for s in mats)
        on_dev = sum(s.rows * s.k for s in mats if s.fixed or self._selected)
        return on_dev / total if total else 1.0

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically (an in-flight update is waited for first).

        Like ``torch.optim``, the tensors are the live state, not copies: a checkpoint streams
        them to disk without a second copy of the state in memory (zfctl/train/tensorfile.py),
        and ``torch.save`` of the dict works as usual; take copies to keep a snapshot while
        training goes on. The host state is saved as pieces keyed by parameter name and column
        range (reshard.py): a process of any world size can load the pieces that cover its columns.
        """
        self._drain()
        live = self._dev_acc.buf if self._dev_acc is not None else None  # the device path's unfinished sum
        pipeline = self.pipeline.state_dict(live_acc=live)
        host = None
        if self.host is not None:
            host = split_host(self.layout, {**self.host.state_dict(), "acc": pipeline.pop("acc")})
        return pack_state(
            names=self.names, shapes=[list(p.shape) for p in self._params], by_row=self._by_row(),
            config=dataclasses.asdict(self.config),
            param_groups=[{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            partition=self._partition_info(), selected=self._selected, pipeline=pipeline,
            device=self._device.state_dict(), host=host,
            scaler=self._scaler.state_dict() if self._scaler is not None else None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict`` taken from an optimizer over the same parameters and topk_ratio.

        Values may be tensors or lazy file tensors (read straight into the live buffers, see
        reshard.py). Data parallel: the host pieces given must cover this rank's columns; they may
        come from any world size (a resharding resume merges the pieces of the saved ranks it needs).
        """
        check_state(state_dict, names=self.names, shapes=[list(p.shape) for p in self._params],
                    by_row=self._by_row(), topk_ratio=self.config.topk_ratio, partition=self._partition_info())
        parts = unpack_state(state_dict)
        self._drain()
        if self._stream is not None:
            self._stream.disarm()
        if self.host is not None:  # checked before anything is overwritten: a gap raises here
            host = parts["host"]
            pieces = host if isinstance(host, list) else split_host(self.layout, host)  # format 1: flat
            check_covers(self.layout, pieces)
        for group, saved in zip(self.param_groups, parts["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        pipeline = parts["pipeline"]
        live_acc = self._dev_acc.buf if self._dev_acc is not None else None
        if self.host is not None:
            self.host.wait_install()
            # Straight into the live buffers, piece by piece: no gathered copy of the state. The
            # unfinished sum goes where the pipeline will read it (its current accumulator, or the
            # device path's device buffer).
            cur = pipeline["counters"]["cur"] % len(self.host.acc)
            acc = live_acc if live_acc is not None else self.host.acc[cur]
            gather_host(self.layout, pieces, into={**self.host.state_dict(), "acc": acc})
            pipeline["acc"] = acc
        self.pipeline.load_state_dict(pipeline, live_acc=live_acc)
        self._selected = parts["selected"]
        self._device.load_state_dict(parts["device"])
        if self.host is not None:
            self.host.device_owned.zero_()
            for s in self._selectable:
                if (index := self._device.index[s.index]) is not None:
                    self.host.set_device_owned(s, index)
            self._refresh_chunks()
        if self._scaler is not None and parts["scaler"] is not None:
            self._scaler.load_state_dict(parts["scaler"])

    def _by_row(self) -> list[str]:
        """Names of the matrices split by row (layout.py), in parameter order."""
        return [s.name for s in self.layout.slots if s.by_row]

    def host_ranges(self) -> list[tuple[str, int, int]]:
        """(name, c0, c1) of the host column ranges this optimizer holds: what a resharding
        resume must find in the saved pieces (reshard.py)."""
        return owned_ranges(self.layout)

    def _partition_info(self) -> dict[str, Any]:
        """Which share of the host state this optimizer holds (one process: all of it), and
        ``ranges``: every rank's pieces as [name, owner, c0, c1] (identical on every rank)."""
        if self._part is None:
            return {"world_size": 1, "rank": 0,
                    "ranges": [[s.name, 0, 0, s.cols] for s in self.layout.host_slots]}
        names = [s.name for s in self.layout.slots]
        return {"world_size": self._part.world_size, "rank": self._part.rank, "bounds": list(self._part.bounds),
                "ranges": [[names[pc.index], pc.owner, pc.c0, pc.c1] for pc in self._part.pieces]}


class _Clock:
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


def _named_params(params: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """Normalise tensors / (name, tensor) pairs; drop frozen ones; reject groups and duplicates."""
    named, seen = [], set()
    for i, item in enumerate(params):
        if isinstance(item, dict):
            raise TypeError("ZenFlowOptimizer takes one parameter group: pass tensors or (name, tensor) pairs")
        name, p = item if isinstance(item, tuple) else (f"param{i}", item)
        if not isinstance(p, torch.Tensor) or not isinstance(name, str):
            raise TypeError(f"expected a tensor or a (name, tensor) pair, got {type(item).__name__}")
        if id(p) in seen:
            raise ValueError(f"parameter {name!r} is given twice")
        if not p.is_floating_point():
            raise ValueError(f"parameter {name!r} has dtype {p.dtype}; ZenFlow trains floating-point weights")
        seen.add(id(p))
        if p.requires_grad:
            named.append((name, p))
    if not named:
        raise ValueError("ZenFlowOptimizer got no trainable parameters")
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    return named


def _count_device_waits(stats: StepStats, pairs: list[tuple[Any, Any]]) -> None:
    """Add the device-side waits of this step (the compute stream idle until a copy landed, timed
    with events, pcie.timed_wait) to its stall, read one step late like the device timings."""
    if not pairs:
        return
    pairs = list(pairs)

    def read(st: StepStats) -> None:
        ms = waited_ms(pairs)
        st.device_wait_ms += ms
        st.stall_ms += ms

    stats.defer(read)
