"""Gradient release (``zenflow.tuning.release_grads``): each gradient leaves the device inside its
own hook on the last backward of a step, and its ``.grad`` is freed there, so the device never
holds every gradient at once (docs/design.md, "Algorithm" and "Threads and buffer ownership").

On the announced last backward (``ZenFlowOptimizer.prepare_backward(final=True)``), the
post-accumulate-grad hook of each parameter

1. (host columns) hands the gradient to the hook path (stream.py ``GradStream.on_grad``): data
   parallel, the exchange over the ranks first, completed one hook later; then the host columns
   are copied into the step's gradient slot (slots.py), raw, in the model dtype, as on every host
   path: the step's coefficient (clip factor / fp16 loss scale), known only after the last hook,
   is recorded with the slot by step() and applied by the CPU update to this step alone;
2. gathers the columns the device owns (and whole 1-D params) into the device state's fp32
   gradient work buffer, raw (``DeviceAdam.load_one``; step() multiplies the buffer by the
   step's coefficient, the same two operations as without release, so the same bits);
3. (one process, clipping or fp16) takes the gradient's L2 norm (``scaler.param_norm``, the
   kernel ``GradientScale.coefficient`` runs over the same tensor: the same global norm); its
   non-finiteness is the fp16 overflow flag, read with the step's scalars;
4. frees the ``.grad``.

So release changes no arithmetic: every path clips each step by its own factor. A parameter whose
hook does not fire (no gradient in that backward) keeps whatever ``.grad`` it has (an earlier
micro-batch's, or None), and step() takes it as before. The hooks are on the matrices only: a 1-D
param's (norm weight, bias) gradient is a few KB, and a hook for it costs more time than it frees
(measured: the hooks of tiny-llama's 11 norm weights were ~2% of a CPU step), so it waits for
step() as before. Data parallel, the hooks are on the matrices with host columns only (the others
are exchanged by step()'s bucketed all-reduce from ``.grad``) and the norm comes from the
exchange. Selection steps of several ranks, backwards not announced as final and
``update_interval: auto`` keep ``.grad`` until step() (their rules read the whole gradient there).
An fp16 overflow step is skipped everywhere: its slot is not recorded, the next step rewrites it.

A selection step (one process) selects from the hooks' column scores; ``regather`` then lays the
work buffer out by the new selection, with the step's slot as the host side: it is the interval's
first step, so the slot holds exactly this step's raw host columns.

Cost: per hook, one gather of the device columns and one norm kernel (one process) on the device,
no host sync; device memory: the gradient being processed plus the hook path's temporaries in
flight (``tuning.inflight_mb``), instead of ``w P``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from zfctl.offload.device_adam import DeviceAdam
from zfctl.offload.layout import Layout, ParamSlot, as_matrix
from zfctl.offload.ledger import NOWHERE
from zfctl.offload.scaler import param_norm
from zfctl.offload.selection import Staging, column_l1


class GradRelease:
    """The release hooks of one optimizer and what they leave for step() (one window per step)."""

    def __init__(self, params: list[torch.Tensor], layout: Layout, device_state: DeviceAdam, *,
                 stream: Any = None, hooked: list[int], norm: bool) -> None:
        self.params, self.layout, self.device_state = params, layout, device_state
        self.stream = stream  # stream.GradStream of the hook path, or None (no host columns)
        self.streamed = {s.index for s in layout.host_slots} if stream is not None else set()
        self.norm = norm  # take each gradient's norm (one process, clipping or fp16)
        if stream is not None:
            stream.on_final = self._take
        self._handles = [params[i].register_post_accumulate_grad_hook(self._hook_for(i)) for i in hooked]
        self.armed = False
        self.selected = False
        self.scoring = False  # the next step selects: keep each matrix's column L1 scores
        self.reset()

    def reset(self) -> None:
        self.norms: dict[int, torch.Tensor] = {}  # per param: the L2 norm its hook took
        self.loaded: set[int] = set()  # params whose device columns are in the work buffer
        self.released: set[int] = set()  # params whose .grad a hook freed
        self.scores: dict[int, torch.Tensor] = {}  # per selectable param: its column L1 (selection steps)

    def arm(self, selected: bool, scoring: bool = False) -> None:
        """Release the next backward's gradients (``selected``: the device owns its selection;
        ``scoring``: the step selects, so keep the column scores it ranks by)."""
        self.reset()
        self.armed, self.selected, self.scoring = True, selected, scoring

    def disarm(self) -> None:
        self.armed = False
        self.reset()

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self.armed:
                return
            if index in self.streamed:
                assert self.stream is not None and self.stream.armed  # armed together (optimizer)
                self.stream.on_grad(index, p)  # lands it, then calls _take (data parallel: later)
            else:
                self._take(index)

        return hook

    @torch.no_grad()
    def _take(self, index: int) -> None:
        """Param ``index``'s final gradient: its device columns into the work buffer, its norm,
        then free it (its host columns were landed just before, stream.py)."""
        p = self.params[index]
        g = p.grad
        if g is None:
            return
        if index in self.loaded:  # a second backward in one window: its gradient would replace the first
            raise RuntimeError("ZenFlowOptimizer.prepare_backward(final=True) announces ONE backward: call "
                               "step() after it (earlier micro-batches take final=False)")
        self.device_state.load_one(self.layout.slots[index], g, self.selected)
        self.loaded.add(index)
        if self.norm:
            self.norms[index] = param_norm(g)
        slot = self.layout.slots[index]
        if self.scoring and slot.selects:  # 4 B per column, what Selector.select ranks by
            self.scores[index] = column_l1(as_matrix(g, slot))
        p.grad = None  # the device memory goes back to the caching allocator (stream-ordered)
        self.released.add(index)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@torch.no_grad()
def regather(device_state: DeviceAdam, slots: list[ParamSlot], old: list[torch.Tensor | None], loaded: set[int],
             grad_slot: torch.Tensor, stage: Staging | None = None) -> tuple[int, int]:
    """After a selection on a release step: lay the work buffer's raw gradient out by the new
    selection (``device_state.index``; ``old``: the one the hooks gathered by), for the params in
    ``loaded``. Staying columns move inside the buffer; entering columns come back from the step's
    slot (``grad_slot``: the hooks landed them there raw, in the model dtype; widened to fp32 on
    the device, exactly); leaving columns go into it (narrowed to the model dtype on the device:
    exact, the work buffer widened them from it), where the CPU update finds them with the
    step's coefficient. Returns (D2H, H2D) bytes. ``stage``: the migration's page-locked buffer
    (selection.py ``Staging``), which both copies go through in pieces; None: fresh tensors.
    """
    d2h = h2d = 0
    for slot in slots:
        new = device_state.index[slot.index]
        if slot.index not in loaded or new is None:
            continue
        seg = device_state.segment(device_state.grad, slot)  # [k, rows], laid out by ``old``
        rows = slot.host_view(grad_slot)  # [owned host columns, rows], model dtype
        new_h = new.to("cpu")
        prev = old[slot.index]
        old_h = prev.to("cpu") if prev is not None else torch.empty(0, dtype=torch.int64)
        stays = torch.isin(new_h, old_h)
        before = seg.clone()  # a device copy of k columns: ``seg`` is rewritten below
        leaving = ~torch.isin(old_h, new_h)
        if bool(leaving.any()):  # PCIe D2H: the leaving columns' gradient into the slot
            pos, cols = torch.nonzero(leaving).flatten().to(seg.device), old_h[leaving] - slot.host_c0
            d2h += _to_slot(before, pos, rows, cols, stage)
        stay_src = torch.searchsorted(old_h, new_h[stays]).to(seg.device)
        seg.index_copy_(0, torch.nonzero(stays).flatten().to(seg.device), before.index_select(0, stay_src))
        enter = new_h[~stays]
        if enter.numel():  # PCIe H2D: the entering columns' gradient, from the slot
            dst = torch.nonzero(~stays).flatten().to(seg.device)
            h2d += _from_slot(seg, dst, rows, enter - slot.host_c0, stage)
    return d2h, h2d


def _staged(stage: Staging, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The front of the staging buffer's bytes as a ``dtype`` tensor of ``shape``."""
    return stage.buf.view(dtype)[: math.prod(shape)].view(shape)


def _per_piece(stage: Staging | None, row: int, itemsize: int, n: int) -> int:
    """Rows of ``row`` elements of ``itemsize`` bytes per copy: what the staging holds, or all."""
    return max(1, stage.buf.numel() * stage.buf.element_size() // (row * itemsize)) if stage is not None else max(1, n)


def _to_slot(d: torch.Tensor, pos: torch.Tensor, h: torch.Tensor, cols: torch.Tensor, stage: Staging | None) -> int:
    """Device rows ``pos`` of the fp32 ``d`` into host rows ``cols`` of the slot view ``h``, in its
    dtype, through ``stage`` in pieces (one blocking D2H each: a selection step only); bytes moved."""
    per, moved = _per_piece(stage, h.shape[1], h.element_size(), len(cols)), 0
    ledger = stage.ledger if stage is not None else NOWHERE
    for a in range(0, len(cols), per):
        tmp = d.index_select(0, pos[a : a + per]).to(h.dtype)  # device gather, narrowed (exact)
        buf = _staged(stage, tuple(tmp.shape), h.dtype) if stage is not None else torch.empty_like(tmp, device="cpu")
        with ledger.waiting("host.migrate_copy"):
            buf.copy_(tmp)  # PCIe D2H (into page-locked memory with a stage); blocking
        h.index_copy_(0, cols[a : a + per], buf)
        nbytes = tmp.numel() * tmp.element_size()
        ledger.moved("host.stage", 2 * nbytes)  # the DMA writes the stage, the scatter reads it ...
        ledger.moved("host.migrate", nbytes)  # ... and writes the slot
        moved += nbytes
    return moved


def _from_slot(d: torch.Tensor, dst: torch.Tensor, h: torch.Tensor, cols: torch.Tensor, stage: Staging | None) -> int:
    """Host rows ``cols`` of the slot view ``h`` into device rows ``dst`` of the fp32 ``d``, widened
    on the device (exact), through ``stage`` in pieces; bytes moved."""
    per, moved = _per_piece(stage, h.shape[1], h.element_size(), len(cols)), 0
    ledger = stage.ledger if stage is not None else NOWHERE
    for a in range(0, len(cols), per):
        c = cols[a : a + per]
        buf = _staged(stage, (len(c), h.shape[1]), h.dtype) if stage is not None else torch.empty(
            (len(c), h.shape[1]), dtype=h.dtype)
        torch.index_select(h, 0, c, out=buf)  # host gather, in place: no fresh pages with a stage
        # PCIe H2D of the model dtype, blocking (the buffer is reused next piece). Off CUDA ``to``
        # returns ``buf`` itself, which ``to(d.dtype)`` copies before the next piece rewrites it.
        with ledger.waiting("host.migrate_copy"):
            d.index_copy_(0, dst[a : a + per], buf.to(d.device).to(d.dtype))
        nbytes = buf.numel() * buf.element_size()
        ledger.moved("host.migrate", nbytes)  # the gather reads the slot ...
        ledger.moved("host.stage", 2 * nbytes)  # ... and writes the stage, the DMA reads it
        moved += nbytes
    return moved
