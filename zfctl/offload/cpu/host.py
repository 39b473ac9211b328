"""The host half of ZenFlow's state: column-major fp32 master, moments, counters and the gradient slots.

Buffers (flat, one column space for all matrices, see ``layout``), and who owns them when:

| buffer | size (elements) | owner between boundaries | owner while a CPU update runs |
| --- | --- | --- | --- |
| master (fp32; page-locked on CUDA when it is the install source) | this rank's matrix columns | main thread (migration, state_dict); the install's DMA reads it until ``install_fence`` when it is the source | CPU worker (reads and writes, after ``install_fence``) |
| upload (model dtype, bf16/fp16 with ``upload_buffer``; page-locked on CUDA) | as master | the install's H2D DMA reads it until ``install_fence`` | CPU worker (writes, after ``install_fence``) |
| exp_avg, exp_avg_sq (fp32) | as master | main thread | CPU worker |
| steps (fp32 per column) | one per column | main thread; at a selection, the worker's fill reads the entering columns' counters between ``hand`` and ``arrive`` (the main thread writes none then: the leaving ones before ``hand``) | main thread (the worker gets counts by value) |
| gradient slots (``grads``, slots.py; model dtype, page-locked on CUDA) | slots per set x sets x as master | the copy stream writes step j's slot of the current set | CPU worker reads the set of the interval it was handed; with one set, the next interval's writes follow the worker's watermark (``gate``, acc_gate.py) |
| the device path's interval sum (``grads.carry[0]``, fp32, page-locked) | as master | its D2H at the boundary, after the previous update was collected | CPU worker |

The install's source (``install_source``; chunks.py, install.py). For a bf16/fp16 model with
``zenflow.tuning.upload_buffer`` (``upload_dtype``: auto is on where the host holds it) it is
``upload``: the CPU AdamW writes the new params rounded to the model dtype (round to nearest
even, native/kernels.h) in the same pass that writes the master (``adamw_step(out=...)``), so
an install DMAs 2 B per element instead of the 4 B of the fp32 master, and the scatter on the
device is a plain copy: the same bits the device's rounding of the master gave. Cost: 2 B per
element of host memory and 2 B more written per element by the update; the master is then not
read by any DMA and stays pageable (a selection's migration goes through its own page-locked
staging, selection.py). An fp32 model has no upload buffer (the master is its own model-dtype
copy), nor a bf16/fp16 one without ``upload_buffer`` (the device rounds the master while it
scatters it, 4 B per element over PCIe): the master is then page-locked on CUDA and the install
DMAs from it. The upload holds the master's rounding
for every host-owned column at every install: the update before it wrote them all (a selection
collects the update in flight first, so no install comes between a migration and the next
update), and a load recomputes it (``refresh_upload``).

How many slot sets (``zenflow.tuning.host_accumulators``, resolved by ``slot_sets``): one,
except with ``overlap_step`` on the host paths when the choice is 2 (the next interval writes one
while the worker reads the other). With one and ``overlap_step``, the worker reads the interval's
slots piece by piece while the next interval's writes wait for it to pass (``gate``, acc_gate.py).
The device path has no slots, one fp32 sum: its interval sum lands there only at the boundary,
after the previous update was collected (optimizer.py ``_boundary``: collect, copy out, submit).
There is ONE set of moments in every mode. Host memory per matrix element: 12 B (master + moments)
plus the slots, ``per_set x sets x itemsize`` (the device path: 4 B of sum instead), plus 2 B of
upload buffer (bf16/fp16 with ``upload_buffer``), plus 13 B per column of bookkeeping
(docs/design.md, "Host memory"; zfctl/plan/lines.py counts the same).

Rows of the selected columns exist here too (their host copy is stale while the device owns
them); keeping the full column range avoids re-packing the buffers at every re-selection and lets
one native call with a run list skip them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zfctl.offload.columns.selection import ColumnState
from zfctl.offload.device import pinned
from zfctl.offload.device.pcie import host_wait
from zfctl.offload.grads.acc_gate import AccGate
from zfctl.offload.grads.slots import GradSlots
from zfctl.offload.layout import Layout, ParamSlot, as_matrix, column_runs
from zfctl.offload.ledger import NOWHERE, Ledger

AUTO_HOST_SHARE = 0.85  # host_accumulators: auto without a plan: the host state within this share of free RAM


def slot_sets(choice: int | str, *, overlap: bool, summed_on_host: bool, committed_bytes: int,
              set_bytes: int) -> int:
    """How many gradient slot sets to build (``zenflow.tuning.host_accumulators``, slots.py).

    One unless ``overlap_step`` lands the next interval on the host while the worker reads this
    one (the host paths); there ``1`` or ``2`` as given, and ``auto`` is 2 when what the host state
    takes (``committed_bytes``, one set included) plus the second set (``set_bytes``) stays within
    ``AUTO_HOST_SHARE`` of the RAM available now. A run plan resolves ``auto`` before the optimizer
    is built, against its machine (zfctl/plan/memory.py, zfctl/train/optim.py); this rule is for a
    library user without a plan.
    """
    if not (overlap and summed_on_host):
        return 1
    if choice != "auto":
        return int(choice)
    free = available_ram()
    return 2 if free is None or committed_bytes + set_bytes <= AUTO_HOST_SHARE * free else 1


def upload_dtype(choice: bool | str, dtype: torch.dtype, *, committed_bytes: int, upload_bytes: int) -> torch.dtype | None:
    """``zenflow.tuning.upload_buffer`` for a model in ``dtype``: the upload buffer's dtype, or None
    for none (the install then DMAs the fp32 master). fp32 has none (the master is its own copy);
    bf16/fp16 as ``choice`` says, and ``auto`` when what the host state takes (``committed_bytes``)
    plus the buffer (``upload_bytes``) stays within ``AUTO_HOST_SHARE`` of the RAM available now.
    A run plan resolves ``auto`` before the optimizer is built (zfctl/plan/memory.py,
    zfctl/train/optim.py); this rule is for a library user without a plan."""
    if dtype.itemsize >= 4 or choice is False:
        return None
    if choice == "auto":
        free = available_ram()
        if free is not None and committed_bytes + upload_bytes > AUTO_HOST_SHARE * free:
            return None
    return dtype


def available_ram() -> float | None:
    """Bytes of RAM available to a new allocation now (``MemAvailable``), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


class HostState:
    """fp32 optimizer state of the matrices' host-owned columns (one process: all of them; data
    parallel: this rank's column ranges ``[slot.host_c0, slot.host_c1)``).

    ``grads``: where the interval's gradient waits for the CPU update (slots.py: the host paths'
    per-step slots, or the device path's fp32 sum). ``upload``: the model dtype of the upload
    buffer (bf16/fp16), or None (an fp32 model: the master is the install source). ``pin``:
    page-lock the install source (CUDA: the install DMAs straight from it).
    """

    ledger: Ledger = NOWHERE  # where its waits are counted (ledger.py; the optimizer's own)

    def __init__(self, layout: Layout, params: list[torch.Tensor], *, grads: GradSlots,
                 upload: torch.dtype | None = None, pin: bool = False) -> None:
        self.layout = layout
        n, f32 = layout.host_numel, torch.float32
        device = params[layout.host_slots[0].index].device if layout.host_slots else None
        self.master = pinned.empty(n, f32, pin=pin and upload is None, device=device)
        self.upload = pinned.empty(n, upload, pin=pin, device=device) if upload is not None else None
        self.exp_avg = torch.zeros(n, dtype=f32)
        self.exp_avg_sq = torch.zeros(n, dtype=f32)
        self.steps = torch.zeros(layout.host_cols, dtype=f32)
        self.grads = grads
        self.gate = AccGate()  # one slot set with overlap: the worker's watermark over it
        self.device_owned = torch.zeros(layout.host_cols, dtype=torch.bool)  # True: column selected
        # The event after the last H2D copy that reads ``install_source`` (an install, chunks.py),
        # or None. Whoever writes the source next waits for it first: the CPU worker (its fence),
        # a checkpoint load (``wait_install``), and, when the source is the master, a selection's
        # migration (``wait_master``).
        self.install_fence: Any = None
        for slot in layout.host_slots:
            # One D2H copy of each matrix at construction (transposed to column-major on the device).
            src = as_matrix(params[slot.index].detach(), slot)[:, slot.host_c0 : slot.host_c1]
            slot.host_view(self.master).copy_(src.t().contiguous().to("cpu"))
        self.refresh_upload()

    @property
    def install_source(self) -> torch.Tensor:
        """What an install DMAs: the upload buffer (bf16/fp16 models), else the fp32 master."""
        return self.upload if self.upload is not None else self.master

    @property
    def update_bytes(self) -> int:
        """Host memory one CPU update moves per host-owned element beside its gradient reads (each
        slot's itemsize, a carry's 4 B: ledger.py ``count_adamw_sum``): master and moments read and
        written (24 B), and the upload written (2 B, bf16/fp16)."""
        return 24 + (self.upload.element_size() if self.upload is not None else 0)

    def refresh_upload(self) -> None:
        """The upload buffer from the master (construction, a checkpoint load: nothing else writes
        the master's columns into it). torch's CPU cast rounds to nearest even like the native
        kernel's ``out``: the same bits for every finite value (a NaN stays a NaN)."""
        if self.upload is not None:
            self.upload.copy_(self.master)

    def column_state(self, slot: ParamSlot) -> ColumnState:
        cols = self.steps[slot.host_col0 : slot.host_col0 + slot.host_c1 - slot.host_c0]
        return ColumnState(slot.host_view(self.master), slot.host_view(self.exp_avg),
                           slot.host_view(self.exp_avg_sq), cols)

    def release(self) -> None:
        """Unpin the page-locked buffers (``close()``); they stay valid as pageable memory."""
        for buf in (self.master, *([self.upload] if self.upload is not None else [])):
            pinned.release(buf)
        self.grads.release()

    def wait_install(self) -> None:
        """Host wait until no install DMA reads ``install_source`` any more (before anyone writes
        or unpins it)."""
        fence, self.install_fence = self.install_fence, None
        if fence is not None:
            host_wait(self.ledger, "host.install_dma", fence)  # sync point: the install's last H2D chunk

    def wait_master(self) -> None:
        """Before the main thread writes the master (a selection's migration): the install's DMA
        reads it only when it is the install source (an fp32 model). With an upload buffer nothing
        waits here, and the fence stays for the CPU worker, the upload's next writer."""
        if self.upload is None:
            self.wait_install()

    def set_device_owned(self, slot: ParamSlot, index: torch.Tensor) -> None:
        """Mark which of ``slot``'s columns the device owns (``index``: column ids, any device)."""
        owned = self._owned(slot)
        owned.zero_()
        index = index.to("cpu")
        index = index[(index >= slot.host_c0) & (index < slot.host_c1)]  # data parallel: own range only
        owned[index - slot.host_c0] = True

    def set_owned(self, owned: torch.Tensor) -> None:
        """Mark the device-owned columns of every matrix at once: ``owned``, sorted flat host column
        ids (columns/selection.py ``SelectionPlan.owned``, already inside this rank's ranges).
        Every other column becomes host-owned: the matrices that select nothing own none anyway.
        Two ops over the host columns (a zero, one index fill), none per matrix."""
        self.device_owned.zero_()
        self.device_owned.index_fill_(0, owned.to("cpu"), True)

    def _owned(self, slot: ParamSlot) -> torch.Tensor:
        return self.device_owned[slot.host_col0 : slot.host_col0 + slot.host_c1 - slot.host_c0]

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
        """Master, moments and counters: the live buffers themselves, not copies (as
        ``torch.optim`` does; a checkpoint streams them to disk, see zfctl/train/tensorfile.py).
        The unfinished interval's sum belongs to the pipeline's state (it depends on its
        counters); ``device_owned`` follows from the selection."""
        return {k: getattr(self, k) for k in self.STATE_KEYS}

    def canonicalize(self, acc: torch.Tensor, *, fresh: bool) -> torch.Tensor:
        """Make an interval sum (the host paths' partial sum, or the device path's device buffer)
        what a checkpoint stores, in place, and return it: dead elements become zeros.

        Nothing ever reads the device-owned elements (the slots' chunks carry them along, the
        device path's first step leaves them), so they hold leftovers that differ between a
        straight and a resumed run; ``fresh`` (the interval has no step yet) means nothing in it
        is live. Zeroing what nobody reads changes nothing for the run and keeps saved states
        comparable bit for bit, without a per-element mask (one ``index_fill_`` of the selected
        columns per matrix).
        """
        if fresh:
            return acc.zero_()
        for slot in self.layout.host_slots:
            ids = torch.nonzero(self._owned(slot)).flatten()
            if ids.numel():
                slot.host_view(acc).index_fill_(0, ids.to(acc.device), 0.0)
        return acc


def fill(dst: torch.Tensor, src: Any) -> None:
    """``dst.copy_(src)`` for a tensor of the same number of elements, or ``src.copy_to(dst)`` for a
    lazy tensor (a range of a checkpoint file, read straight into ``dst``: no second copy)."""
    if src is dst:
        return  # loaded in place already (gather_host wrote the live buffer)
    if isinstance(src, torch.Tensor):
        dst.copy_(src.reshape(dst.shape))
    else:
        src.copy_to(dst)
