"""Where the gradients are copied device to host: the three gradient paths, chosen once.

Every step, the non-selected columns' gradients are added into the interval's fp32 sum, and at
a boundary the CPU update reads that sum on the host. Three paths do it, with the same sum
(docs/design.md, "Algorithm" and "Transfer scheduling"); the optimizer picks one when it is
built and then only calls the :class:`GradientPath` methods, in its step's phases:

* :class:`InStep` (``stream_grads: false``): ``step()`` copies the gradient columns device to
  host through the D2H ring and accumulates them on the host (chunks.py ``offload_gradients``);
* :class:`DuringBackward` (``stream_grads``, ``accumulate: host``): gradient hooks copy them
  device to host during the last backward and a host thread accumulates them (stream.py); steps
  whose backward was not announced, and selection steps (except with ``release_grads`` in one
  process: release.py), fall back to :class:`InStep`;
* :class:`SummedOnDevice` (``accumulate: device``): the sum lives on the device
  (device_acc.py); only the interval sum is copied device to host, once, at the boundary.

The column chunks and the two rings that move them (gradients D2H inside ``step()``, installed
params H2D: install.py) are :class:`Transfers`, shared by the paths and the install.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zfctl.errors import ConfigError
from zfctl.offload import cores
from zfctl.offload.bandwidth import measure_d2h_gbps
from zfctl.offload.chunks import offload_gradients, plan_chunks
from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.device_acc import DeviceAccumulator, resolve
from zfctl.offload.host import HostState, accumulator_count, upload_dtype
from zfctl.offload.layout import Layout
from zfctl.offload.ledger import NOWHERE, Ledger, counted_accumulate
from zfctl.offload.pcie import count_waits
from zfctl.offload.ring import Ring
from zfctl.offload.sizing import inflight_bytes, landing_slots, ring_slot_bytes  # the plan's rules too
from zfctl.offload.stats import StepStats
from zfctl.offload.stream import GradStream
from zfctl.offload.threads import capped

Fence = Callable[[], Any]


class Transfers:
    """The host-owned columns cut into slot-sized chunks, and the D2H and H2D rings (chunks.py)."""

    def __init__(self, layout: Layout, host: HostState, device: torch.device, config: ZenFlowConfig,
                 itemsize: int, *, on_device: bool) -> None:
        slots = layout.host_slots
        biggest = max(slots, key=lambda s: s.rows)
        want = int(config.tuning.ring_slot_mb * 2**20)
        if biggest.rows * itemsize > want:
            need = biggest.rows * itemsize / 2**20
            raise ConfigError("zenflow.tuning.ring_slot_mb", config.tuning.ring_slot_mb,
                              f"one column of {biggest.name!r} is {need:.3f} MiB; use at least that")
        slot_bytes = ring_slot_bytes(want, config.tuning.ring_slots, biggest.rows, layout.host_numel, itemsize)
        # D2H: model-dtype gradient chunks (the step() path; its host slots unused where the sum
        # lives on the device, which only fetches scalars). H2D: the same column ranges of the
        # install source, copied straight from it into device slots: the model dtype (the upload
        # buffer, or an fp32 model's master), or the fp32 master of a bf16/fp16 model without an
        # upload buffer, 4/itemsize times the bytes.
        self.d2h = Ring(device, config.tuning.ring_slots, slot_bytes, config.tuning.pin_memory,
                        host_slots=not on_device)
        source = host.install_source.element_size()
        self.h2d = Ring(device, config.tuning.ring_slots, slot_bytes * source // itemsize, config.tuning.pin_memory,
                        host_slots=False)
        self.layout, self.host, self.itemsize = layout, host, itemsize
        self.replan()

    def replan(self) -> None:
        """Re-plan the chunks after the device-owned columns changed (a selection, a load)."""
        self.chunks = plan_chunks(self.layout, self.host.device_owned, self.d2h.slot_bytes, self.itemsize)


    def release(self) -> None:
        self.d2h.release()
        self.h2d.release()


class GradientPath(Protocol):
    """How one step's non-selected gradient columns get into the interval's sum (module docstring).

    Phases of a step: ``begin`` (``prepare_backward``), ``exchanged`` (data parallel: what the
    hooks exchanged), ``add_device`` (in the device update), ``add_host`` (once the coefficient is
    on the host), and at a boundary ``finish``: after the previous CPU update is collected, it
    returns what the next one must wait for before it reads the sum (``None``: nothing).
    ``write_order``: (offset, elements) of the chunks in the order the path writes the host
    accumulator each step, the order a CPU update sharing it reads in (acc_gate.py); ``None``
    when the path does not write the host accumulator between boundaries.
    """

    d2h_gbps: float | None  # the D2H rate measured at construction (hook path on CUDA), else None
    live_acc: torch.Tensor | None  # where the unfinished sum lives when not in the host accumulator

    def begin(self, *, final: bool, acc: torch.Tensor | None, first: bool, coef: float | None) -> None: ...

    def exchanged(self) -> set[int]: ...

    def add_device(self, grads: list[torch.Tensor | None], coef: torch.Tensor | None, *, first: bool,
                   stats: StepStats) -> None: ...

    def add_host(self, grads: list[torch.Tensor | None], acc: torch.Tensor, coef: float, *, first: bool,
                 stats: StepStats) -> None: ...

    def finish(self, acc: torch.Tensor, stats: StepStats) -> Fence | None: ...

    def write_order(self) -> list[tuple[int, int]] | None: ...

    def skip(self, stats: StepStats) -> None: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...


class NoHostColumns:
    """Nothing to move: every column lives on the device (``topk_ratio: 1``). The base of the
    paths below: each phase does nothing unless a path says otherwise."""

    d2h_gbps: float | None = None
    live_acc: torch.Tensor | None = None

    def begin(self, *, final: bool, acc: torch.Tensor | None, first: bool, coef: float | None) -> None:
        pass

    def exchanged(self) -> set[int]:
        return set()

    def add_device(self, grads: list[torch.Tensor | None], coef: torch.Tensor | None, *, first: bool,
                   stats: StepStats) -> None:
        pass

    def add_host(self, grads: list[torch.Tensor | None], acc: torch.Tensor, coef: float, *, first: bool,
                 stats: StepStats) -> None:
        pass

    def finish(self, acc: torch.Tensor, stats: StepStats) -> Fence | None:
        return None

    def write_order(self) -> list[tuple[int, int]] | None:
        return None

    def skip(self, stats: StepStats) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class InStep(NoHostColumns):
    """``step()`` copies the gradient columns device to host through the D2H ring, chunk by chunk,
    and accumulates each one on the host as it lands (all of it inside step(): stall)."""

    def __init__(self, transfers: Transfers, accumulate: Callable[..., None]) -> None:
        self.transfers, self.accumulate = transfers, accumulate

    def add_host(self, grads: list[torch.Tensor | None], acc: torch.Tensor, coef: float, *, first: bool,
                 stats: StepStats) -> None:
        t = self.transfers
        wait = t.host.gate.waiter() if first else None  # one accumulator: the update in flight reads it
        # Bytes: counted where they move (the ring's D2H, the native accumulate; ledger.py).
        offload_gradients(t.d2h, t.chunks, grads, acc, coef, self.accumulate, overwrite=first, wait_read=wait)
        stats.in_step_chunks = len(t.chunks)
        stats.in_step_bytes = sum(ch.numel for ch in t.chunks) * t.itemsize

    def write_order(self) -> list[tuple[int, int]] | None:
        return [(ch.off, ch.numel) for ch in self.transfers.chunks]  # offload_gradients' order


class DuringBackward(InStep):
    """The last backward's gradient hooks copy the columns device to host and a host thread adds
    them (stream.py): ``step()`` copies nothing. Unannounced backwards and selection steps (but
    those of ``release_grads`` in one process, release.py) take :class:`InStep`'s copy."""

    def __init__(self, transfers: Transfers, accumulate: Callable[..., None], params: list[torch.Tensor], *,
                 device: torch.device, config: ZenFlowConfig, exchange: Any, release: bool,
                 hooks: bool = True) -> None:
        super().__init__(transfers, accumulate)
        layout, itemsize = transfers.layout, transfers.itemsize
        # Device temporaries in flight: what the link drains in ~2 ms at the rate measured once
        # here (bandwidth.py; a sync, at construction only), or zenflow.inflight_mb when set. Off
        # CUDA there is no link to measure: 4x the ring. Never more than the host-path gradient.
        self.d2h_gbps = measure_d2h_gbps(device)
        if config.tuning.inflight_mb:
            budget = int(config.tuning.inflight_mb * 2**20)
        elif self.d2h_gbps is not None:
            budget = inflight_bytes(self.d2h_gbps)
        else:
            budget = 4 * config.tuning.ring_slots * transfers.d2h.slot_bytes
        budget = min(budget, layout.host_numel * itemsize)
        dtype = params[layout.host_slots[0].index].dtype
        # release_grads: the copies land in a ring as large as the device budget (whole chunk-sized
        # slots, at least two), not in two copies of the host columns' gradient (landing_slots).
        slot_bytes = transfers.d2h.slot_bytes
        ring = landing_slots(budget, slot_bytes) if release else 0
        self.stream = GradStream(params, layout.host_slots, numel=layout.host_numel, dtype=dtype, device=device,
                                 pin_memory=config.tuning.pin_memory, budget_bytes=max(budget, 1), accumulate=accumulate,
                                 exchange=exchange, gate=transfers.host.gate, ring_slots=ring,
                                 slot_bytes=slot_bytes, hooks=hooks and not release)
        self._fence: Fence | None = None  # the boundary's CPU update waits for the last hook job

    def begin(self, *, final: bool, acc: torch.Tensor | None, first: bool, coef: float | None) -> None:
        if final and acc is not None:
            self.stream.arm(self.transfers.chunks, acc, coef, first=first)
        else:
            self.stream.disarm()

    def exchanged(self) -> set[int]:
        return self.stream.complete_exchanges() if self.stream.armed else set()

    def add_host(self, grads: list[torch.Tensor | None], acc: torch.Tensor, coef: float, *, first: bool,
                 stats: StepStats) -> None:
        if not self.stream.armed:  # an unannounced backward, or a selection step
            self.stream.drain()  # the thread may still add the previous step into acc
            self._fence = None
            super().add_host(grads, acc, coef, first=first, stats=stats)
            return
        t = self.transfers
        fence = self.stream.finish(stats, coef, t.itemsize)  # the hooks moved it; the thread adds it
        self._fence = fence.result if fence is not None else None

    def finish(self, acc: torch.Tensor, stats: StepStats) -> Fence | None:
        fence, self._fence = self._fence, None
        return fence

    def write_order(self) -> list[tuple[int, int]] | None:
        # The backward finishes gradients roughly last layer first: matrices in reverse order,
        # each one's chunks in column order (its hook lands them so). An estimate is enough: the
        # order decides only how soon a write may pass, never a value (acc_gate.py).
        chunks = sorted(self.transfers.chunks, key=lambda ch: (-ch.slot.index, ch.c0))
        return [(ch.off, ch.numel) for ch in chunks]

    def skip(self, stats: StepStats) -> None:
        if self.stream.armed:
            self.stream.finish(stats, None, self.transfers.itemsize)  # drop what the hooks moved

    def drain(self) -> None:
        self.stream.drain()

    def close(self) -> None:
        self.stream.close()


class SummedOnDevice(NoHostColumns):
    """The interval's sum lives on the device (device_acc.py); only the sum's host-owned columns
    are copied device to host, once per interval, after the previous CPU update was collected
    (its one accumulator).
    Nothing happens on the host per step (``add_host`` is the base's no-op)."""

    def __init__(self, transfers: Transfers, device: torch.device) -> None:
        self.transfers = transfers
        self.sum = DeviceAccumulator(transfers.layout, device)
        self.live_acc = self.sum.buf

    def add_device(self, grads: list[torch.Tensor | None], coef: torch.Tensor | None, *, first: bool,
                   stats: StepStats) -> None:
        self.sum.add(grads, coef, first=first)
        count_waits(stats, self.sum.stall_pairs, "device.sum_copy")  # compute waiting for the last copy out

    def finish(self, acc: torch.Tensor, stats: StepStats) -> Fence | None:
        # The host-owned spans of the fp32 sum, once per interval, written into host memory; the
        # update follows them matrix by matrix (a PieceWaits, pipeline.py ``submit``). Counted
        # there (ledger.py).
        return self.sum.copy_out(acc, self.transfers.chunks)

    def drain(self) -> None:
        self.sum.wait()


@dataclass
class HostSide:
    """What an optimizer with host columns adds: the state, the transfers, the gradient path, and
    the split of the cores between accumulation and the CPU update (threads.py)."""

    host: HostState
    transfers: Transfers
    path: GradientPath
    accumulate: str  # zenflow.accumulate as resolved: "host" or "device"
    threads: tuple[int, int]  # (accumulation, update) native threads


def build_host_side(layout: Layout, params: list[torch.Tensor], device: torch.device, config: ZenFlowConfig, *,
                    exchange: Any, release: bool, hooks: bool = True, ledger: Ledger = NOWHERE) -> HostSide:
    """Host buffers, transfers and the gradient path (r < 1 only), chosen once here. ``release``:
    the hook path's gradients are released in their hooks (release.py), if it is the one chosen.
    ``hooks=False``: the hook path registers no hooks on ``params``, its owner calls
    ``GradStream.on_grad`` (FSDP2 shards: from the DTensors' hooks, sharded.py). ``ledger``:
    where the transfers, the accumulation and the host state count their bytes and waits."""
    from zfctl import _native  # raises UserError("run make setup") when the library is missing

    dtypes = {params[s.index].dtype for s in layout.host_slots}
    if len(dtypes) > 1:
        raise ValueError(f"offloaded weights must share one dtype, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    itemsize = dtype.itemsize
    accumulate = resolve(config.accumulate, device, 4 * layout.host_numel, params)
    on_device = accumulate == "device"
    cuda_pin = device.type == "cuda" and config.tuning.pin_memory
    # A second accumulator only helps where the next interval is summed on the host while the
    # worker reads the last one (overlap, host paths): zenflow.tuning.host_accumulators (one:
    # the next interval's first writes follow the worker, acc_gate.py). The device path sums on
    # the device and lands the sum in its one host accumulator after the previous update was
    # collected (SummedOnDevice.finish).
    hook = config.tuning.stream_grads and not on_device
    count = accumulator_count(config.tuning.host_accumulators, overlap=config.overlap_step, summed_on_host=not on_device,
                              committed_bytes=(16 + (2 * itemsize if hook else 0)) * layout.host_numel,
                              acc_bytes=4 * layout.host_numel)
    # bf16/fp16 (zenflow.tuning.upload_buffer): the CPU AdamW writes the installed params in the
    # model dtype (host.py upload) and only that buffer is page-locked for the install's DMA;
    # fp32, or without it: the master itself is.
    upload = upload_dtype(config.tuning.upload_buffer, dtype, upload_bytes=itemsize * layout.host_numel,
                          committed_bytes=(12 + 4 * count + (2 * itemsize if hook else 0)) * layout.host_numel)
    # The core split (cores.py): the training thread's reserved cores, the pools' pinned CPUs, and
    # on a multi-node machine the GPU's NUMA node, where the host state is allocated and bound.
    # The device path adds nothing on the host between boundaries (its sum lives on the device):
    # the CPU update takes every pool core there.
    plan = cores.plan_for(config, device, on_device=on_device)
    with cores.on_node(plan):
        host = HostState(layout, params, accumulators=count, upload=upload, pin=cuda_pin, pin_acc=cuda_pin and on_device)
        transfers = Transfers(layout, host, device, config, itemsize, on_device=on_device)
    buffers = [host.master, host.exp_avg, host.exp_avg_sq, *host.acc]
    cores.bind_host(plan, _native, buffers + ([host.upload] if host.upload is not None else []))
    threads = cores.apply(plan, _native)
    add = counted_accumulate(capped(_native, threads[0]), ledger)  # host.sum bytes, on whichever thread adds
    path: GradientPath
    if on_device:
        path = SummedOnDevice(transfers, device)
    elif config.tuning.stream_grads:
        path = DuringBackward(transfers, add, params, device=device, config=config, exchange=exchange,
                              release=release, hooks=hooks)
    else:
        path = InStep(transfers, add)
    for part in (transfers.d2h, transfers.h2d, host, getattr(path, "stream", None), getattr(path, "sum", None)):
        if part is not None:
            part.ledger = ledger  # each counts what it moves and waits for (ledger.py)
    return HostSide(host, transfers, path, accumulate, threads)
