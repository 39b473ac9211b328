"""Gradient release (``zenflow.tuning.release_grads``): each gradient leaves the device inside its
own hook on the last backward of a step, and its ``.grad`` is freed there, so the device never
holds every gradient at once (docs/design.md, "Algorithm" and "Threads and buffer ownership").

On the announced last backward (``ZenFlowOptimizer.prepare_backward(final=True)``), the
post-accumulate-grad hook of each parameter

1. (host columns) hands the gradient to the hook path (stream.py ``GradStream.on_grad``): data
   parallel, the exchange over the ranks first, completed one hook later; then the host columns
   are copied into the step's gradient slot (slots.py), raw, in the model dtype, as on every host
   path: step() records the slot with the step's unscale (1 / fp16 loss scale, or 1) and the
   step's clip factor, known only after the last hook, into the interval's clip sum, whose mean
   the CPU update applies to the interval's sum (the interval-mean rule, cpu/pipeline.py);
2. gathers the columns the device owns (and whole 1-D params) into the device state's fp32
   gradient work buffer, raw (``DeviceAdam.load_one``; step() multiplies the buffer by the
   step's coefficient, the same two operations as without release, so the same bits);
3. (one process, clipping or fp16) takes the gradient's L2 norm (``scaler.param_norm``, the
   kernel ``GradientScale.coefficient`` runs over the same tensor: the same global norm); its
   non-finiteness is the fp16 overflow flag, read with the step's scalars;
4. frees the ``.grad``.

So release changes no arithmetic: every path takes one clip rule (the device-owned columns each
step's own factor, the host-owned ones the interval's mean factor). A parameter whose
hook does not fire (no gradient in that backward) keeps whatever ``.grad`` it has (an earlier
micro-batch's, or None), and step() takes it as before. The hooks are on the matrices only: a 1-D
param's (norm weight, bias) gradient is a few KB, and a hook for it costs more time than it frees
(measured: the hooks of tiny-llama's 11 norm weights were ~2% of a CPU step), so it waits for
step() as before. Data parallel, the hooks are on the matrices with host columns only (the others
are exchanged by step()'s bucketed all-reduce from ``.grad``) and the norm comes from the
exchange. Selection steps of several ranks, backwards not announced as final and
``update_interval: auto`` keep ``.grad`` until step() (their rules read the whole gradient there).
An fp16 overflow step is skipped everywhere: its slot is not recorded, the next step rewrites it.

A selection step (one process) selects from the hooks' column scores; ``regather_pairs`` then
moves the work buffer's columns with the new selection (the asynchronous migration, migration.py),
with the step's slot as the host side: it is the interval's first step, so the slot holds exactly
this step's raw host columns.

Cost: per hook, one gather of the device columns and one norm kernel (one process) on the device,
no host sync; device memory: the gradient being processed plus the hook path's temporaries in
flight (``tuning.inflight_mb``), instead of ``w P``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zfctl.offload.columns.departure import Departure, Pair
from zfctl.offload.columns.selection import Moves, column_l1
from zfctl.offload.device.device_adam import DeviceAdam
from zfctl.offload.grads.device_to_host import DuringBackward
from zfctl.offload.grads.scaler import param_norm
from zfctl.offload.layout import Layout, as_matrix


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


def regather_pairs(loaded: set[int], grad_slot: torch.Tensor) -> Callable[[Moves, Departure], Pair | None]:
    """A selection on a release step: the work buffer's raw gradient follows the columns too
    (selector.py ``select``'s ``extra``, moved with the state by migration.py), for the params in
    ``loaded`` (the hooks gathered them by the old selection). Staying columns move inside the
    buffer; entering columns come back from the step's slot (``grad_slot``, slots.py: the hooks
    landed them there raw, in the model dtype; widened to fp32 exactly on their way in); leaving
    columns go into it (narrowed to the model dtype: exact, the work buffer widened them from it),
    where the CPU update finds them with the step's unscale, through ``to``
    (``Selector.land``: the main thread writes them before the interval is handed to the worker;
    a selection step is always an interval's first step: the step before it ends an interval)."""
    def pairs(m: Moves, to: Departure) -> Pair | None:
        if m.slot.index not in loaded:  # no hook took it: step() gathers it by the new selection
            return None
        return Pair(m.slot.host_view(grad_slot), to)  # the device side: DeviceAdam.grad's block rows

    return pairs


def build_release(opt: Any, release: bool) -> GradRelease | None:
    """The release hooks of optimizer ``opt`` where they apply: the hook path (``accumulate:
    host``), or no host columns at all in one process; None elsewhere. On the matrices only: a
    1-D param's gradient is tiny, and a hook for it would cost more time than the bytes it frees
    (its .grad waits for step(), as before)."""
    path = opt.gradient_path
    if not release or not (isinstance(path, DuringBackward) or (opt.host is None and opt.exchange is None)):
        return None
    stream = path.stream if isinstance(path, DuringBackward) else None
    hooked = ([s.index for s in opt.layout.host_slots] if opt.exchange is not None
              else [s.index for s in opt.layout.slots if not s.dense])
    return GradRelease(opt.params, opt.layout, opt.device_state, stream=stream, hooked=hooked,
                       norm=opt.scale.needs_norm and opt.exchange is None)
