"""Gradient release (``zenflow.tuning.release_grads``): each gradient leaves the device inside its
own hook on the last backward of a step, and its ``.grad`` is freed there, so the device never
holds every gradient at once (docs/design.md, "Algorithm" and "Threads and buffer ownership").

On the announced last backward (``ZenFlowOptimizer.prepare_backward(final=True)``), the
post-accumulate-grad hook of each parameter

1. (host columns) hands the gradient to the hook path (stream.py ``GradStream.on_grad``): data
   parallel, the exchange over the ranks first, completed one hook later; then the host columns
   are copied through the bounded landing ring and added into the interval's fp32 sum, times
   the coefficient known before backward (1, or 1 / the fp16 loss scale), without the clip
   factor, which exists only once every gradient does;
2. gathers the columns the device owns (and whole 1-D params) into the device state's fp32
   gradient work buffer, raw (``DeviceAdam.load_one``; step() multiplies the buffer by the
   step's coefficient, the same two operations as without release, so the same bits);
3. (one process, clipping or fp16) takes the gradient's L2 norm (``scaler.param_norm``, the
   kernel ``GradientScale.coefficient`` runs over the same tensor: the same global norm); its
   non-finiteness is the fp16 overflow flag, read with the step's scalars;
4. frees the ``.grad``.

A parameter whose hook does not fire (no gradient in that backward) keeps whatever ``.grad`` it
has (an earlier micro-batch's, or None), and step() takes it as before. The hooks are on the
matrices only: a 1-D param's (norm weight, bias) gradient is a few KB, and a hook for it costs
more time than it frees (measured: the hooks of tiny-llama's 11 norm weights were ~2% of a CPU
step), so it waits for step() as before. Data parallel, the hooks are on the matrices with host
columns only (the others are exchanged by step()'s bucketed
all-reduce from ``.grad``) and the norm comes from the exchange. Selection steps, backwards not
announced as final and ``update_interval: auto`` keep ``.grad`` until step() (their rules read
the whole gradient there).

The clip factor of step t, ``c_t``, is known only after the last hook, so what the hooks added is
``sum_t g_t`` (raw): the boundary scales the interval's mean gradient by the interval's mean clip
factor, ``mean(c_t)`` (``Pipeline.clip_sum``). The sums turn raw at the first announced backward
that starts an interval and stay so (``Pipeline.raw_sums``; steps step() moves itself add raw too),
so no interval mixes the two; a loop that never calls ``prepare_backward`` sees no change at all. With no clipping, or a clip that does not trigger
(``c_t = 1``), that is the arithmetic without release, bit for bit; otherwise it is the documented
"interval mean clip" rule. An fp16 overflow step is skipped everywhere; what its hooks already
added cannot be taken out of the sum, so the interval's host sum is dropped (the next step starts
a new interval).

Cost: per hook, one gather of the device columns and one norm kernel (one process) on the device,
no host sync; device memory: the gradient being processed plus the hook path's temporaries in
flight (``tuning.inflight_mb``), instead of ``w P``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zfctl.offload.device_adam import DeviceAdam
from zfctl.offload.layout import Layout, ParamSlot, as_matrix
from zfctl.offload.scaler import param_norm
from zfctl.offload.selection import Staging, column_l1, in_staged, out_staged


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
             acc: torch.Tensor, coef: float, stage: Staging | None = None) -> tuple[int, int]:
    """After a selection on a release step: lay the work buffer's raw gradient out by the new
    selection (``device_state.index``; ``old``: the one the hooks gathered by), for the params in
    ``loaded``. Staying columns move inside the buffer; entering columns come back from the host
    sum, where the hooks added them times ``coef`` (1 / the fp16 loss scale, a power of two: the
    division is exact) as the interval's first step (a selection step always is: the step before
    it ends an interval); leaving columns go into that sum the same way. Returns (D2H, H2D) bytes.
    ``stage``: the migration's page-locked buffer (selection.py ``Staging``), which both copies go
    through in pieces; None: through fresh pageable tensors.
    """
    d2h = h2d = 0
    for slot in slots:
        new = device_state.index[slot.index]
        if slot.index not in loaded or new is None:
            continue
        seg = device_state.segment(device_state.grad, slot)  # [k, rows], laid out by ``old``
        rows = slot.host_view(acc)  # [owned host columns, rows]
        new_h = new.to("cpu")
        prev = old[slot.index]
        old_h = prev.to("cpu") if prev is not None else torch.empty(0, dtype=torch.int64)
        stays = torch.isin(new_h, old_h)
        before = seg.clone()  # a device copy of k columns: ``seg`` is rewritten below
        leaving = ~torch.isin(old_h, new_h)
        if bool(leaving.any()):  # PCIe D2H: the leaving columns' gradient into the host sum
            pos, cols = torch.nonzero(leaving).flatten().to(seg.device), old_h[leaving] - slot.host_c0
            if stage is not None:
                d2h += out_staged(before, pos, rows, cols, stage, mul=coef)
            else:
                moved = before.index_select(0, pos).to("cpu")
                rows.index_copy_(0, cols, moved * coef)
                d2h += moved.numel() * moved.element_size()
        stay_src = torch.searchsorted(old_h, new_h[stays]).to(seg.device)
        seg.index_copy_(0, torch.nonzero(stays).flatten().to(seg.device), before.index_select(0, stay_src))
        enter = new_h[~stays]
        if enter.numel():  # PCIe H2D: the entering columns' gradient, from the host sum
            dst = torch.nonzero(~stays).flatten().to(seg.device)
            if stage is not None:
                h2d += in_staged(seg, dst, rows, enter - slot.host_c0, stage, div=coef)
            else:
                back = (rows.index_select(0, enter - slot.host_c0) / coef).to(seg.device)
                seg.index_copy_(0, dst, back)
                h2d += back.numel() * back.element_size()
    return d2h, h2d
