"""The host half of ZenFlow's state: column-major fp32 master, moments, counters and accumulators.

Buffers (flat, one column space for all matrices, see ``layout``), and who owns them when:

| buffer | size (elements) | owner between boundaries | owner while a CPU update runs |
| --- | --- | --- | --- |
| master, exp_avg, exp_avg_sq (fp32) | all matrix columns | main thread (migration, state_dict) | CPU worker (reads and writes) |
| steps (fp32 per column) | all columns | main thread | main thread (the worker gets counts by value) |
| acc[i] (fp32) | all columns | main thread (or the stream's thread) writes then adds into acc[cur] | CPU worker reads acc[other] |
| upload (model dtype; bf16/fp16 only) | all columns | main thread reads it to install | CPU worker writes it |

``acc`` is double-buffered only with ``overlap_step`` (the next interval accumulates while the
worker reads the last one); there is ONE set of moments in both modes, so overlap on and off are
the same optimizer apart from the staleness of the non-selected columns. For fp32 models the
master itself is what gets installed, so there is no upload buffer. Host memory per matrix
element: 12 B (master+moments) + 4 B per accumulator + 2 B upload (bf16/fp16) = 18-22 B.

Rows of the selected columns exist here too (their host copy is stale while the device owns
them); keeping the full column range avoids re-packing the buffers at every re-selection and lets
one native call with a run list skip them.
"""

from __future__ import annotations

import torch

from zfctl.offload.layout import Layout, ParamSlot, as_matrix, column_runs
from zfctl.offload.selection import ColumnState


class HostState:
    """fp32 optimizer state of the matrices' host-owned columns (one process: all of them; data
    parallel: this rank's column ranges ``[slot.host_c0, slot.host_c1)``)."""

    def __init__(self, layout: Layout, params: list[torch.Tensor], *, double_buffer: bool,
                 upload_dtype: torch.dtype | None, pin_acc: bool = False) -> None:
        self.layout = layout
        n, f32 = layout.host_numel, torch.float32
        self.master = torch.empty(n, dtype=f32)
        self.exp_avg = torch.zeros(n, dtype=f32)
        self.exp_avg_sq = torch.zeros(n, dtype=f32)
        self.steps = torch.zeros(layout.host_cols, dtype=f32)
        # pin_acc (accumulate=device on CUDA): the accumulators are the target of the interval
        # sum's async D2H, so they are page-locked.
        self.acc = [torch.zeros(n, dtype=f32, pin_memory=pin_acc) for _ in range(2 if double_buffer else 1)]
        self.upload = torch.zeros(n, dtype=upload_dtype) if upload_dtype is not None else None
        self.device_owned = torch.zeros(layout.host_cols, dtype=torch.bool)  # True: column selected
        for slot in layout.host_slots:
            # One D2H copy of each matrix at construction (transposed to column-major on the device).
            src = as_matrix(params[slot.index].detach(), slot)[:, slot.host_c0 : slot.host_c1]
            self.view(self.master, slot).copy_(src.t().contiguous().to("cpu"))

    def view(self, buf: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """A slot's owned columns of a flat host buffer as ``[ncols, rows]`` (row = column)."""
        return buf[slot.host_off : slot.host_off + slot.host_numel].view(slot.host_c1 - slot.host_c0, slot.rows)

    def column_state(self, slot: ParamSlot) -> ColumnState:
        cols = self.steps[slot.host_col0 : slot.host_col0 + slot.host_c1 - slot.host_c0]
        return ColumnState(self.view(self.master, slot), self.view(self.exp_avg, slot),
                           self.view(self.exp_avg_sq, slot), cols)

    def set_device_owned(self, slot: ParamSlot, index: torch.Tensor) -> None:
        """Mark which of ``slot``'s columns the device owns (``index``: column ids, any device)."""
        owned = self.device_owned[slot.host_col0 : slot.host_col0 + slot.host_c1 - slot.host_c0]
        owned.zero_()
        index = index.to("cpu")
        index = index[(index >= slot.host_c0) & (index < slot.host_c1)]  # data parallel: own range only
        owned[index - slot.host_c0] = True

    def update_groups(self, steps: int = 1) -> list[tuple[int, torch.Tensor]]:
        """(1-based Adam step, runs) per distinct counter among the host-owned columns, for an
        update of ``steps`` Adam steps (``zenflow.deferred_lr_scale: repeat``; else 1).

        Columns that never left the host share one counter; each group of columns that came back
        from the device with its own count adds one group. Each group is one native call. The
        counters advance here, on the main thread, at submission: the worker receives the step
        numbers by value and never reads ``steps``.
        """
        host = ~self.device_owned
        groups = []
        for value in torch.unique(self.steps[host]).tolist():
            runs = column_runs(host & (self.steps == value), self.layout.host_col_offsets)
            groups.append((int(value) + 1, runs))
        self.steps[host] += steps
        return groups

    # -- checkpoints ----------------------------------------------------------------------------
    STATE_KEYS = ("master", "exp_avg", "exp_avg_sq", "steps")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Master, moments and counters (copies). Accumulators and the upload buffer belong to the
        pipeline's state (which one is live depends on its counters); ``device_owned`` follows
        from the selection."""
        return {k: getattr(self, k).clone() for k in self.STATE_KEYS}

    def canonical_acc(self, acc: torch.Tensor, *, fresh: bool) -> torch.Tensor:
        """A copy of an accumulator as a checkpoint stores it: what a resumed run can read.

        The first step of an interval writes the host-owned elements and nothing ever reads the
        device-owned ones, so those hold leftovers of older intervals that differ between a
        straight and a resumed run. They are saved as zeros (``fresh``: the interval has no step
        yet, so nothing is live), which keeps saved states comparable bit for bit.
        """
        if fresh:
            return torch.zeros_like(acc, device="cpu")
        lengths = self.layout.host_col_offsets[1:] - self.layout.host_col_offsets[:-1]
        owned = self.device_owned.repeat_interleave(lengths)
        return acc.to("cpu", copy=True).masked_fill_(owned, 0.0)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k in self.STATE_KEYS:
            getattr(self, k).copy_(sd[k])
