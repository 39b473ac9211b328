"""Where the gradients are copied device to host: the gradient paths, chosen once.

Every step, the non-selected columns' gradient joins the interval's, and at a boundary the CPU
update reads the interval on the host. Two kinds of path do it (docs/design.md, "Algorithm" and
"Transfer scheduling"); the optimizer picks one when it is built and then only calls the
:class:`GradientPath` methods, in its step's phases:

* the host paths land each step's gradient columns in their own slot (slots.py), in the model
  dtype, through one copy stream (stream.py ``GradStream``), and nothing runs on the host per
  step: the worker sums the slots inside its AdamW pass. They differ only in who issues the copy:
  :class:`DuringBackward` (``accumulate: host``): gradient hooks, during the announced last
  backward (release.py frees each ``.grad`` there with ``release_grads``); what no hook landed
  step() lands itself (its base :class:`InStep`): a step whose final backward was not announced
  (``prepare_backward``), a selection step, loss scaling under the carry layout (``lands_early``
  False), a matrix whose hook did not fire. Under
  ``zenflow.tuning.grad_layout: carry`` the same stream lands each chunk in a small landing ring
  instead and folds it into one fp32 sum per host element (carry.py ``GradCarry``: 4 B per
  element instead of the slots' ``U x itemsize`` per set), with the same bits;
* :class:`SummedOnDevice` (``accumulate: device``): the sum lives on the device (device_acc.py);
  only the interval sum is copied device to host, once, at the boundary, into one fp32 buffer
  the worker reads as the chain's carry (slots.py).

The column chunks and the rings that move data (the step's scalars D2H inside ``step()``, installed
params H2D: install.py) are :class:`Transfers`, shared by the paths and the install.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zfctl.errors import ConfigError
from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.cpu import cores
from zfctl.offload.cpu.host import HostState, slot_sets, upload_dtype
from zfctl.offload.device.chunks import plan_chunks
from zfctl.offload.device.pcie import count_waits
from zfctl.offload.device.ring import Ring
from zfctl.offload.grads.acc_gate import Waiter
from zfctl.offload.grads.bandwidth import measure_d2h_gbps
from zfctl.offload.grads.carry import GradCarry
from zfctl.offload.grads.device_acc import DeviceAccumulator, resolve
from zfctl.offload.grads.slots import GradSlots
from zfctl.offload.grads.stream import GradStream
from zfctl.offload.layout import Layout
from zfctl.offload.ledger import NOWHERE, Ledger
from zfctl.offload.sizing import (  # the plan's rules too
    carry_host_bytes,
    inflight_bytes,
    ring_slot_bytes,
    slots_per_set,
)
from zfctl.offload.stats import StepStats

Fence = Callable[[], Any]


class Transfers:
    """The host-owned columns cut into ring-slot-sized chunks, and the D2H and H2D rings (chunks.py)."""

    def __init__(self, layout: Layout, host: HostState, device: torch.device, config: ZenFlowConfig,
                 itemsize: int, *, on_device: bool) -> None:
        slots = layout.host_slots
        biggest = max(slots, key=lambda s: s.rows)
        want = int(config.tuning.ring_slot_mb * 2**20)
        if biggest.rows * itemsize > want:
            need = biggest.rows * itemsize / 2**20
            raise ConfigError("zenflow.tuning.ring_slot_mb", config.tuning.ring_slot_mb,
                              f"one column of {biggest.name!r} is {need:.3f} MiB; use at least that")
        slot_bytes = _ring_slot_bytes(layout, config, itemsize)
        # D2H: the step's scalars only (``fetch``): gradients land in the interval's slots
        # (stream.py); its slot size cuts the chunks. H2D: the same column ranges of the install
        # source, copied straight from it into device slots: the model dtype (the upload buffer,
        # or an fp32 model's master), or the fp32 master of a bf16/fp16 model without an upload
        # buffer, 4/itemsize times the bytes.
        self.d2h = Ring(device, config.tuning.ring_slots, slot_bytes, config.tuning.pin_memory)
        source = host.install_source.element_size()
        self.h2d = Ring(device, config.tuning.ring_slots, slot_bytes * source // itemsize, config.tuning.pin_memory)
        self.layout, self.host, self.itemsize = layout, host, itemsize
        self.replan()

    def replan(self) -> None:
        """Re-plan the chunks after the device-owned columns changed (a selection, a load)."""
        self.chunks = plan_chunks(self.layout, self.host.device_owned, self.d2h.slot_bytes, self.itemsize)


class GradientPath(Protocol):
    """How one step's non-selected gradient columns join the interval (module docstring).

    Phases of a step: ``begin`` (``prepare_backward``: ``slot`` is where the step lands, None when
    the backward is not the last), ``exchanged`` (data parallel: what the hooks exchanged),
    ``add_device`` (in the device update), ``add_host`` (inside step(): land what is left into
    ``slot``), and at a boundary ``finish``: after the previous CPU update is collected, it
    returns what the next one must wait for before it reads the interval (``None``: nothing).
    ``write_order``: (offset, elements) of the chunks in the order the path writes a slot each
    step, the order a CPU update sharing one slot set reads in (acc_gate.py); ``None`` when the
    path writes no slots.
    """

    d2h_gbps: float | None  # the D2H rate measured at construction (CUDA), else None
    live_acc: torch.Tensor | None  # the device path's device sum (the unfinished interval), else None

    def begin(self, *, final: bool, slot: torch.Tensor | None) -> None: ...

    def exchanged(self) -> set[int]: ...

    def add_device(self, grads: list[torch.Tensor | None], coef: torch.Tensor | None, *, first: bool,
                   stats: StepStats) -> None: ...

    def add_host(self, slot: torch.Tensor | None, stats: StepStats) -> None: ...

    def finish(self, stats: StepStats) -> Fence | None: ...

    def write_order(self) -> list[tuple[int, int]] | None: ...

    def skip(self, stats: StepStats) -> None: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...


class NoHostColumns:
    """Nothing to move: every column lives on the device (``topk_ratio: 1``). The base of the
    paths below: each phase does nothing unless a path says otherwise."""

    d2h_gbps: float | None = None
    live_acc: torch.Tensor | None = None

    def begin(self, *, final: bool, slot: torch.Tensor | None) -> None:
        pass

    def exchanged(self) -> set[int]:
        return set()

    def add_device(self, grads: list[torch.Tensor | None], coef: torch.Tensor | None, *, first: bool,
                   stats: StepStats) -> None:
        pass

    def add_host(self, slot: torch.Tensor | None, stats: StepStats) -> None:
        pass

    def finish(self, stats: StepStats) -> Fence | None:
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
    """The step() path: ``step()`` lands the gradient columns in the step's slot itself (stream.py
    ``finish``): a transpose and a D2H per chunk, inside step() (stall). The base of
    :class:`DuringBackward`, which takes this path on every step its hooks do not land (that
    class's docstring says which); ``hooks``: the subclass's."""

    def __init__(self, transfers: Transfers, params: list[torch.Tensor], *, device: torch.device,
                 config: ZenFlowConfig, exchange: Any = None, hooks: bool = False) -> None:
        self.transfers = transfers
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
        grads = transfers.host.grads
        self.stream = GradStream(params, layout.host_slots, device=device, budget_bytes=max(budget, 1),
                                 exchange=exchange, hooks=hooks, carry=grads if isinstance(grads, GradCarry) else None)

    def _waiter(self) -> Waiter | None:
        """One slot set: each write of a piece waits for the update in flight to have read it
        (acc_gate.py); the ticket is taken now, in step order. Two sets: no wait."""
        host = self.transfers.host
        return host.gate.waiter() if host.grads.sets == 1 else None

    def add_host(self, slot: torch.Tensor | None, stats: StepStats) -> None:
        assert slot is not None  # the host paths always have the step's slot (Pipeline.slot)
        t = self.transfers
        if not self.stream.armed:  # no announced final backward, a selection step, or carry + loss scaling
            self.stream.open(t.chunks, slot, self._waiter())
        self.stream.finish(stats, t.itemsize)  # bytes: counted where they move (stream.py; ledger.py)

    def finish(self, stats: StepStats) -> Fence | None:
        return self.stream.fence()  # the interval's last copy into a slot

    def write_order(self) -> list[tuple[int, int]] | None:
        return [(ch.off, ch.numel) for ch in self.transfers.chunks]  # ``finish``'s order

    def skip(self, stats: StepStats) -> None:
        self.stream.skip()  # what the hooks landed is dropped: the next step rewrites the slot

    def drain(self) -> None:
        self.stream.drain()

    def close(self) -> None:
        self.stream.close()


class DuringBackward(InStep):
    """The last backward's gradient hooks land the columns in the step's slot (stream.py):
    ``step()`` copies only what no hook landed. A step whose final backward was not announced
    (``ZenFlowOptimizer.prepare_backward``: a library loop that never calls it), a selection step
    (but those of ``release_grads`` in one process, release.py) and loss scaling under the carry
    layout (the overflow check comes first, carry.py) are landed by step(), as in :class:`InStep`.
    ``hooks=False``: release.py or FSDP2's hooks call ``GradStream.on_grad``."""

    def __init__(self, transfers: Transfers, params: list[torch.Tensor], *, device: torch.device,
                 config: ZenFlowConfig, exchange: Any, hooks: bool = True) -> None:
        super().__init__(transfers, params, device=device, config=config, exchange=exchange, hooks=hooks)

    def begin(self, *, final: bool, slot: torch.Tensor | None) -> None:
        if final and slot is not None:
            self.stream.arm(self.transfers.chunks, slot, self._waiter())
        else:
            self.stream.disarm()

    def exchanged(self) -> set[int]:
        return self.stream.complete_exchanges() if self.stream.armed else set()

    def write_order(self) -> list[tuple[int, int]] | None:
        # The backward finishes gradients roughly last layer first: matrices in reverse order,
        # each one's chunks in column order (its hook lands them so). An estimate is enough: the
        # order decides only how soon a write may pass, never a value (acc_gate.py).
        chunks = sorted(self.transfers.chunks, key=lambda ch: (-ch.slot.index, ch.c0))
        return [(ch.off, ch.numel) for ch in chunks]


class SummedOnDevice(NoHostColumns):
    """The interval's sum lives on the device (device_acc.py); only the sum's host-owned columns
    are copied device to host, once per interval, after the previous CPU update was collected,
    into the one fp32 host buffer (``host_sum``: slots.py's persistent carry). Nothing happens on
    the host per step."""

    def __init__(self, transfers: Transfers, device: torch.device, host_sum: torch.Tensor) -> None:
        self.transfers = transfers
        self.sum = DeviceAccumulator(transfers.layout, device)
        self.live_acc = self.sum.buf
        self.host_sum = host_sum

    def add_device(self, grads: list[torch.Tensor | None], coef: torch.Tensor | None, *, first: bool,
                   stats: StepStats) -> None:
        self.sum.add(grads, coef, first=first)
        count_waits(stats, self.sum.stall_pairs, "device.sum_copy")  # compute waiting for the last copy out

    def finish(self, stats: StepStats) -> Fence | None:
        # The host-owned spans of the fp32 sum, once per interval, written into the host sum; the
        # update follows them matrix by matrix (a PieceWaits, pipeline.py ``submit``). Counted
        # there (ledger.py).
        return self.sum.copy_out(self.host_sum, self.transfers.chunks)

    def drain(self) -> None:
        self.sum.wait()


@dataclass
class HostSide:
    """What an optimizer with host columns adds: the state, the transfers, the gradient path, and
    the native threads of the CPU update (threads.py, cores.py)."""

    host: HostState
    transfers: Transfers
    path: GradientPath
    accumulate: str  # zenflow.accumulate as resolved: "host" or "device"
    threads: int  # native threads of the CPU update
    # False: the gradient hooks must land nothing (the carry layout under loss scaling, carry.py:
    # a skipped step's folds could not be taken back); step() lands the step after its check.
    lands_early: bool = True


def build_host_side(layout: Layout, params: list[torch.Tensor], device: torch.device, config: ZenFlowConfig, *,
                    exchange: Any, hooks: bool = True, ledger: Ledger = NOWHERE,
                    unscale: Callable[[], float] | None = None) -> HostSide:
    """Host buffers, transfers and the gradient path (r < 1 only), chosen once here.
    ``unscale``: the step's ``1 / loss_scale`` when the loss is scaled (fp16), read when a step's
    landing opens (the carry layout folds with it, carry.py); None: 1.
    ``hooks=False``: the hook path registers no hooks on ``params``; release.py (``release_grads``)
    or FSDP2's hooks on the shards (sharded.py) call ``GradStream.on_grad``. ``ledger``: where the
    transfers, the gradient stream, the host state and the device sum count their bytes and waits."""
    from zfctl import _native  # raises UserError("run make setup") when the library is missing

    dtypes = {params[s.index].dtype for s in layout.host_slots}
    if len(dtypes) > 1:
        raise ValueError(f"offloaded weights must share one dtype, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    itemsize = dtype.itemsize
    accumulate = resolve(config.accumulate, device, 4 * layout.host_numel, params)
    on_device = accumulate == "device"
    cuda_pin = device.type == "cuda" and config.tuning.pin_memory
    n = layout.host_numel
    # The core split (cores.py): the training thread's reserved cores, the update pool's pinned
    # CPUs, and on a multi-node machine the GPU's NUMA node, where the host state is allocated
    # and bound. Nothing runs native code on the host per step: the update takes every pool core.
    plan = cores.plan_for(config, device)
    with cores.on_node(plan):
        grads: GradSlots
        if on_device:  # no slots: the interval's fp32 sum lands in one page-locked buffer (its D2H target)
            grads = GradSlots(n, torch.float32, per_set=0, sets=1, pin=cuda_pin, device=device, sum_buffer=True)
            grad_bytes = 4 * n
        else:
            # A second slot set only helps where the next interval lands while the worker reads
            # this one (overlap): zenflow.tuning.host_accumulators (one: the next interval's writes
            # follow the worker, acc_gate.py).
            per_set = slots_per_set(config.update_interval, config.tuning.auto_max_interval)
            if config.tuning.grad_layout == "carry":  # one fp32 sum and a landing ring (carry.py)
                slot_bytes = _ring_slot_bytes(layout, config, itemsize)
                grads = GradCarry(n, dtype, per_set=per_set, pin=cuda_pin, device=device,
                                  ring_slots=config.tuning.ring_slots, slot_bytes=slot_bytes,
                                  unscale=unscale or (lambda: 1.0))
                grad_bytes = carry_host_bytes(n, config.tuning.ring_slots, slot_bytes)
            else:  # slots (auto reaches here as slots: the plan resolves it, settle.py)
                set_bytes = per_set * itemsize * n
                sets = slot_sets(config.tuning.host_accumulators, overlap=config.overlap_step, summed_on_host=True,
                                 committed_bytes=12 * n + set_bytes, set_bytes=set_bytes)
                grads = GradSlots(n, dtype, per_set=per_set, sets=sets, pin=cuda_pin, device=device)
                grad_bytes = sets * set_bytes
        # bf16/fp16 (zenflow.tuning.upload_buffer): the CPU AdamW writes the installed params in
        # the model dtype (host.py upload) and only that buffer is page-locked for the install's
        # DMA; fp32, or without it: the master itself is.
        upload = upload_dtype(config.tuning.upload_buffer, dtype, upload_bytes=itemsize * n,
                              committed_bytes=12 * n + grad_bytes)
        host = HostState(layout, params, grads=grads, upload=upload, pin=cuda_pin)
        transfers = Transfers(layout, host, device, config, itemsize, on_device=on_device)
    buffers = [host.master, host.exp_avg, host.exp_avg_sq, *grads.buffers]
    buffers += [t for t in (grads.carry[0] if grads.sum_buffer else None, host.upload) if t is not None]
    if isinstance(grads, GradCarry):
        buffers.append(grads.folds.ring)
    cores.bind_host(plan, _native, buffers)
    threads = cores.apply(plan, _native)
    path: GradientPath
    if on_device:
        assert grads.carry[0] is not None  # sum_buffer
        path = SummedOnDevice(transfers, device, grads.carry[0])
    else:
        path = DuringBackward(transfers, params, device=device, config=config, exchange=exchange, hooks=hooks)
    folds = grads.folds if isinstance(grads, GradCarry) else None
    for part in (transfers.d2h, transfers.h2d, host, host.gate, getattr(path, "stream", None),
                 getattr(path, "sum", None), folds):
        if part is not None:
            part.ledger = ledger  # each counts what it moves and waits for (ledger.py)
    # Under loss scaling the carry layout lands a step only after its overflow check (carry.py).
    return HostSide(host, transfers, path, accumulate, threads, lands_early=folds is None or unscale is None)


def _ring_slot_bytes(layout: Layout, config: ZenFlowConfig, itemsize: int) -> int:
    """The D2H ring's slot size (``Transfers``'s rule, sizing.py): the carry's landing ring
    slots are that size, so each chunk fits one."""
    rows = max(s.rows for s in layout.host_slots)
    want = int(config.tuning.ring_slot_mb * 2**20)
    return ring_slot_bytes(want, config.tuning.ring_slots, rows, layout.host_numel, itemsize)
