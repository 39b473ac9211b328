"""AdamW on the device for the columns the device owns, with fp32 master, moments and step counters.

Device-owned elements are the dense params (always) and the selected columns of every matrix
(after the first selection). Their state lives in four flat fp32 buffers (master, exp_avg,
exp_avg_sq, and a gradient work buffer) laid out by ``layout``: equal-length columns sit in one
``[n, length]`` block. Each step the gradients are gathered into the work buffer (one gather per
parameter), the AdamW math runs over whole buffers and blocks (about 20 kernels in total, not per
parameter), and the new masters are cast into the model's bf16/fp16/fp32 params (one scatter per
parameter).

Step counters and bias correction. Every device column has its own fp32 counter: the number of
Adam updates its moments have absorbed, on either path. Bias correction ``1 - beta^t`` uses that
column's counter, so a column that arrives from the host (where it was updated once per CPU update)
continues its own sequence instead of adopting some other column's. fp32 counts exactly up to 2^24
(16.7M updates); the reference implementation's bf16 counter stops at 256. The per-column factors
are computed in float64 (like torch.optim's Python-float bias correction) and rounded to fp32 once.
torch's fused/foreach AdamW kernels take one step count per tensor, which cannot express per-column
counters; the block form below keeps the kernel count just as flat (independent of the number of
parameters) without them.

Cost per step: no host sync; device memory 16 B per device-owned element (master, two moments,
the gradient work buffer), plus 4 B per device column for the counter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zfctl.offload.columns.selection import ColumnState
from zfctl.offload.cpu.host import fill
from zfctl.offload.layout import Layout, ParamSlot, as_matrix, gather_columns


class DeviceAdam:
    """The device half of ZenFlow's state: dense params and selected columns."""

    def __init__(self, layout: Layout, params: list[torch.Tensor], device: torch.device) -> None:
        self.layout = layout
        n, f32 = layout.dev_numel, torch.float32
        self.master = torch.zeros(n, dtype=f32, device=device)
        self.exp_avg = torch.zeros(n, dtype=f32, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=f32, device=device)
        self.grad = torch.zeros(n, dtype=f32, device=device)  # work buffer, rewritten every step
        self.steps = torch.zeros(layout.dev_cols, dtype=f32, device=device)
        # Sorted device column ids per matrix slot (None: not selected yet, or k == 0), and their
        # host copies (a selection plans its moves from them without reading the device).
        self.index: list[torch.Tensor | None] = [None] * len(layout.slots)
        self.index_cpu: list[torch.Tensor | None] = [None] * len(layout.slots)
        for slot, p in zip(layout.slots, params):
            if slot.dense:
                self.segment(self.master, slot).view(-1).copy_(p.detach().reshape(-1))
            elif slot.k == slot.cols:  # topk_ratio 1: the whole matrix lives here from the start
                self.index[slot.index] = torch.arange(slot.cols, device=device)
                self.index_cpu[slot.index] = torch.arange(slot.cols)
                self.segment(self.master, slot).copy_(as_matrix(p.detach(), slot).t())

    # -- views ---------------------------------------------------------------------------------
    def segment(self, buf: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """A slot's rows of a flat buffer: ``[k, rows]`` (row i = device column i of the slot)."""
        return buf[slot.dev_off : slot.dev_off + slot.k * slot.rows].view(slot.k, slot.rows)

    def column_state(self, slot: ParamSlot) -> ColumnState:
        """The slot's device state, for migration and checkpoints."""
        steps = self.steps[slot.dev_col0 : slot.dev_col0 + slot.k]
        return ColumnState(self.segment(self.master, slot), self.segment(self.exp_avg, slot),
                           self.segment(self.exp_avg_sq, slot), steps)

    def active(self, selected: bool) -> tuple[int, int]:
        """(elements, columns) stepped: the fixed prefix before the first selection, else everything."""
        if selected:
            return self.layout.dev_numel, self.layout.dev_cols
        return self.layout.fixed_numel, self.layout.fixed_cols

    def _live(self, slot: ParamSlot, selected: bool) -> bool:
        return slot.k > 0 and (slot.fixed or selected)

    # -- the three phases of a device step -----------------------------------------------------
    def load_grads(self, params: list[torch.Tensor], coef: torch.Tensor | None, selected: bool,
                   loaded: frozenset[int] | set[int] = frozenset()) -> None:
        """Gather this step's gradients of device-owned elements into the fp32 work buffer.

        ``coef`` (a 0-dim device tensor: clip factor / loss scale) multiplies them in one kernel,
        without a host sync. A missing gradient counts as zero (see ZenFlowOptimizer.step).
        ``loaded``: params whose gradient a hook already gathered (``load_one``; release.py).
        """
        for slot, p in zip(self.layout.slots, params):
            if slot.index not in loaded:
                self.load_one(slot, p.grad, selected)
        if coef is not None:
            n, _ = self.active(selected)
            self.grad[:n].mul_(coef)

    def load_one(self, slot: ParamSlot, g: torch.Tensor | None, selected: bool) -> None:
        """Gather one param's raw gradient (exact: a copy, widened to fp32) into its rows of the
        work buffer; the coefficient is applied to the whole buffer by ``load_grads``."""
        if not self._live(slot, selected):
            return
        seg = self.segment(self.grad, slot)
        if g is None:
            seg.zero_()
        elif slot.dense:
            seg.view(-1).copy_(g.reshape(-1))
        elif slot.k == slot.cols:
            seg.copy_(as_matrix(g, slot).t())
        else:
            index = self.index[slot.index]
            assert index is not None, "selected: every selecting matrix has its columns"
            seg.copy_(gather_columns(g, slot, index))

    def step(self, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             selected: bool) -> None:
        """One AdamW update (torch.optim.AdamW's formula and op order) of every active column."""
        n, ncols = self.active(selected)
        if n == 0:
            return
        p, m, v, g = (b[:n] for b in (self.master, self.exp_avg, self.exp_avg_sq, self.grad))
        steps = self.steps[:ncols]
        steps.add_(1)
        t = steps.double()
        step_size = (lr / (1 - torch.pow(beta1, t))).float()
        bc2_sqrt = (1 - torch.pow(beta2, t)).sqrt().float()
        if weight_decay:
            p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        # The gradient is no longer needed: its buffer becomes the scratch for denom and the update.
        for b in self.layout.blocks:
            if b.col0 + b.ncols > ncols:
                break  # selectable blocks, before the first selection
            rows = slice(b.off, b.off + b.ncols * b.length)
            cs = slice(b.col0, b.col0 + b.ncols)
            pb, mb, vb, sb = (x[rows].view(b.ncols, b.length) for x in (p, m, v, g))
            torch.sqrt(vb, out=sb)
            sb.div_(bc2_sqrt[cs].unsqueeze(1)).add_(eps)  # denom = sqrt(v) / sqrt(bc2) + eps
            torch.div(mb, sb, out=sb)
            sb.mul_(step_size[cs].unsqueeze(1))
            pb.sub_(sb)

    def write_params(self, params: list[torch.Tensor], selected: bool,
                     only: Iterable[ParamSlot] | None = None) -> None:
        """Cast the fp32 masters into the model params (round to nearest even for bf16/fp16).

        ``only`` restricts the write to some slots (after an install, the device-owned columns of
        the matrices whose whole columns were just overwritten from the host).
        """
        for slot in self.layout.slots if only is None else only:
            p = params[slot.index]
            if not self._live(slot, selected):
                continue
            seg = self.segment(self.master, slot)
            if slot.dense:
                p.data.copy_(seg.view(p.shape))
            elif slot.k == slot.cols:
                as_matrix(p.data, slot).copy_(seg.t())
            else:
                index = self.index[slot.index]
                assert index is not None, "selected: every selecting matrix has its columns"
                as_matrix(p.data, slot).t().index_copy_(0, index, seg.to(p.dtype))

    # -- checkpoints ----------------------------------------------------------------------------
    STATE_KEYS = ("master", "exp_avg", "exp_avg_sq", "steps")

    def state_dict(self) -> dict:
        """Master, moments, counters (the live device buffers, as ``torch.optim`` returns its state;
        a checkpoint streams them to disk chunk by chunk) and the selection: sorted column ids per
        matrix name (only matrices that have one; small CPU copies)."""
        sd: dict = {k: getattr(self, k) for k in self.STATE_KEYS}
        sd["selection"] = {s.name: index.to("cpu", copy=True) for s in self.layout.slots
                           if s.selects and (index := self.index[s.index]) is not None}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Copy saved values into the live buffers (tensors, or lazy file tensors: host.fill)."""
        for k in self.STATE_KEYS:
            fill(getattr(self, k), sd[k])
        for s in self.layout.slots:
            if s.selects:
                saved = sd["selection"].get(s.name)
                self.index[s.index] = saved.to(self.master.device) if saved is not None else None
                self.index_cpu[s.index] = saved.to("cpu", torch.int64, copy=True) if saved is not None else None
