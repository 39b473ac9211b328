"""``zfctl bench --selection``: one selection's main-thread work, on CPU, at a preset's real shapes.

Drives the real selection code (zfctl/offload/columns/selection.py ``plan_selection`` and
``stay_share``, selector.py ``Selector._migrate``, which builds the groups and calls
columns/migration.py ``Mover.move``, the fill that ``Mover.move`` returns, cpu/worker.py
``CpuWorker._serve``, cpu/host.py ``HostState.set_owned``, device/chunks.py ``plan_chunks``),
each wrapped, never copied, with synthetic old and new column sets of which a chosen share
stays. One torch thread. Phases that read no state run at the preset's real shapes with no state
allocated; the move needs host and device state, so it runs at the real column sets with every
matrix's rows divided by ``ROW_SCALE`` (the 1.24B model's 15 GB of state would not fit beside the
suite), and the staging sizes divided by the same factor, so that it cuts the same pieces: its
bytes are scaled back up by that factor; its op counts and its ms are not (the ms are the main
thread's enqueueing; on CPU the scaled "device" copies run inside them, on a GPU they would not).

Counts: ``device_ops`` are the aten ops issued on the device state during the move, by the main
thread and by the worker's fill (on CPU the device state is CPU memory: an op counts when it
reads or writes those tensors); ``main_thread_gathers`` the ``index_select`` calls on host state
by the main thread. The priority request's run work is ``_serve`` with its AdamW replaced by
nothing (AdamW excluded). ``fill_ms`` is the worker's fill (its host gathers replayed at the real
row widths, ``_gathers_ms``): inside the priority wait, not the main thread's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zfctl.offload import sizing
from zfctl.offload.columns.departure import Departure
from zfctl.offload.columns.migration import Mover
from zfctl.offload.columns.selection import Moves, plan_selection, stay_share
from zfctl.offload.columns.selector import Selector
from zfctl.offload.cpu.host import HostState
from zfctl.offload.cpu.worker import CpuWorker, _Request
from zfctl.offload.device.chunks import plan_chunks
from zfctl.offload.layout import Layout, ParamSlot, plan_layout
from zfctl.offload.ledger import Ledger
from zfctl.offload.sizing import OUT_BYTES, out_elems, ring_elems

ROW_SCALE = 32  # Mover.move's state: rows / 32 (llama3.2-1b: ~0.5 GB of state instead of 15 GB)
PIECES = 128  # the update's pieces at the 1.24B shapes (docs/benchmarks.md, the selection benchmark)
GATHER_BYTES = 256 * 2**20  # the gathers' replay source (``_gathers_ms``)
SLOT_BYTES = 64 * 2**20  # the D2H slot plan_chunks splits matrices by (bf16 gradient)


class _Count(TorchDispatchMode):
    """Aten ops touching ``device`` storages (views apart: they launch nothing), and
    ``index_select`` reading ``host`` storages."""

    def __init__(self, device: set[int], host: set[int]) -> None:
        super().__init__()
        self.device, self.host = device, host
        self.device_ops = self.views = self.gathers = self.gathered = 0  # gathered: elements the gathers read

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        ptrs = {_ptr(a) for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)}
        if ptrs & self.device:
            if func.is_view:
                self.views += 1
            else:
                self.device_ops += 1
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.index_select and ptrs & self.host:
            self.gathers += 1
            self.gathered += out.numel()
        return out


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _layout(model: Any, topk: float, rows_div: int = 1) -> Layout:
    """The layout (zfctl/offload/layout.py ``plan_layout``) of a preset's ModelConfig, from its
    shapes, on the meta device; ``rows_div`` divides every column's length (the move's scaled state)."""
    from zfctl.bench.model import arch_model_config
    from zfctl.plan.schema import RunPlan
    from zfctl.plan.sizes import model_size

    # The bench's --model shapes: a hub preset as a Llama of its arch's sizes (bench/model.py).
    size = model_size(RunPlan(model=arch_model_config(model, seq_len=2048)))
    assert size is not None and size.shapes, f"{model.name}: no shapes"
    named = []
    for name, shape in size.shapes:
        if len(shape) == 2 and rows_div > 1:  # a column is shape[0] long, a by-row one shape[1]
            by_row = name in size.vocab_names
            shape = (shape[0], max(1, shape[1] // rows_div)) if by_row else (max(1, shape[0] // rows_div), shape[1])
        named.append((name, torch.empty(shape, device="meta")))
    return plan_layout(named, topk, frozenset(size.vocab_names))


def _columns(slot: ParamSlot, stay: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted old and new column sets of ``slot.k`` each, ``round(stay * k)`` of them in both (a
    matrix with ``k`` above half its columns keeps them all: no room for that many to enter)."""
    perm = torch.randperm(slot.cols, generator=gen)
    k, kept = slot.k, max(0, min(slot.k, round(stay * slot.k)))
    old = perm[:k]
    new = torch.cat([old[:kept], perm[k : 2 * k - kept]]) if 2 * k - kept <= slot.cols else perm[:k]
    return old.sort().values, new.sort().values


def _timed(phases: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    phases[name] = phases.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
    return out


def _priority(layout: Layout, runs: torch.Tensor, old_owned: torch.Tensor) -> tuple[float, int]:
    """``CpuWorker._serve`` for a request of ``runs`` against an update of the columns that were
    host-owned (``PIECES`` equal pieces), its AdamW and piece waits removed: (ms, run cuts).
    Counter groups as ``HostState.update_groups`` forms them: two, the columns that never left the
    host and a random tenth of them that came back from the device with their own count."""
    steps = (torch.rand(layout.host_cols, generator=torch.Generator().manual_seed(1)) < 0.1).float()
    groups = HostState.update_groups(SimpleNamespace(device_owned=old_owned, steps=steps, layout=layout))  # type: ignore[arg-type]
    n, per = layout.host_numel, -(-layout.host_numel // PIECES)
    pieces = [(o, min(per, n - o), None) for o in range(0, n, per)]
    worker = SimpleNamespace(_cv=threading.Condition(), _request=_Request(runs), _wait_piece=lambda *a: None,
                             _adamw=lambda *a: None, priority_cuts=0)
    left = [(step, r, (r[:, 0] + r[:, 1]).contiguous()) for step, r in groups]
    t0 = time.perf_counter()
    CpuWorker._serve(worker, SimpleNamespace(), pieces, 0, left, set())  # type: ignore[arg-type]
    return (time.perf_counter() - t0) * 1e3, worker.priority_cuts


def _plan(layout: Layout, stay: float, seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[ParamSlot]]:
    gen = torch.Generator().manual_seed(seed)
    sel = [s for s in layout.slots if s.selects]
    return [_columns(s, stay, gen) for s in sel], sel


def _owned(layout: Layout, sel: list[ParamSlot], sets: list[torch.Tensor]) -> torch.Tensor:
    mask = torch.zeros(layout.host_cols, dtype=torch.bool)
    for s, c in zip(sel, sets):
        mask[s.host_col0 + c] = True
    return mask


@contextmanager
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_selection(model: Any, stay: float = 0.1, *, topk: float = 0.1, seed: int = 0,
                  repeats: int = 3) -> dict:
    """A synthetic selection at the shapes of ``model`` (a preset's ModelConfig) with ``stay`` of each matrix's columns staying,
    ``repeats`` times: each time the fastest of the repeats (the box is shared), counts the first's."""
    with _one_thread():
        runs = [_run(model, stay, topk, seed) for _ in range(repeats)]
    out = runs[0]
    out["phases"] = {k: min(r["phases"][k] for r in runs) for k in out["phases"]}
    for key in ("priority_runs_ms", "fill_ms"):
        out[key] = min(r[key] for r in runs)
    out["main_thread_ms"] = sum(out["phases"].values())
    return out


def _run(model: Any, stay: float, topk: float, seed: int) -> dict:
    phases: dict[str, float] = {}
    layout = _layout(model, topk)
    cols, sel = _plan(layout, stay, seed)
    olds, news = [o for o, _ in cols], [n for _, n in cols]
    plan = _timed(phases, "plan_selection", lambda: plan_selection(layout, sel, olds, news))
    _timed(phases, "stay_share", lambda: stay_share(plan.moves))
    old_owned = _owned(layout, sel, olds)
    priority, cuts = _priority(layout, plan.entering_runs, old_owned)
    move = _move(model, stay, topk, seed)
    phases["migrate"] = move["ms"]
    hs: Any = SimpleNamespace(device_owned=old_owned.clone())  # what set_owned reads of a HostState
    _timed(phases, "set_owned", lambda: HostState.set_owned(hs, plan.owned))
    _timed(phases, "plan_chunks", lambda: plan_chunks(layout, hs.device_owned, SLOT_BYTES, 2))
    main = sum(phases.values())
    return {
        "model": model.name, "stay": stay, "topk_ratio": topk, "matrices": len(sel), "host_cols": layout.host_cols,
        "selected_cols": sum(s.k for s in sel),
        "entering_cols": sum(int(m.enter_cols.numel()) for m in plan.moves),
        "leaving_cols": sum(int(m.leave_cols.numel()) for m in plan.moves),
        "entering_runs": int(plan.entering_runs.shape[0]), "device_blocks": len(plan.blocks),
        "main_thread_ms": main, "priority_runs_ms": priority, "priority_cuts": cuts,
        "fill_ms": _gathers_ms(plan.moves),
        "device_ops": move["main_ops"] + move["fill_ops"], "device_ops_main": move["main_ops"],
        "device_ops_fill": move["fill_ops"], "device_views": move["views"], "main_thread_gathers": move["main_gathers"],
        "fill_gathers": move["fill_gathers"], "main_thread_gather_share": move["gathered_share"],
        "bytes": {"d2h": move["d2h"], "h2d": move["h2d"], "host": move["host"]},
        "row_scale": ROW_SCALE, "phases": phases,
    }


def _gathers_ms(moves: list[Moves]) -> float:
    """The in ring's host gathers (migration.py ``Mover._fill``, the worker: ``index_select`` of the entering
    columns' rows into the ring) at the real row widths, replayed as one gather per matrix and
    state tensor out of one ``GATHER_BYTES`` host buffer (ids modulo its columns: random rows of
    memory far beyond the caches, as the real state is) into one reused ring-sized buffer."""
    src = torch.ones(GATHER_BYTES // 4)
    most = max(int(m.enter_cols.numel()) * m.slot.rows for m in moves)
    out = torch.empty(max(1, most))
    ms = 0.0
    for m in moves:
        n, rows = int(m.enter_cols.numel()), m.slot.rows
        host = src[: (src.numel() // rows) * rows].view(-1, rows)
        cols = m.enter_cols % host.shape[0]
        for _ in range(3):  # master, exp_avg, exp_avg_sq
            t0 = time.perf_counter()
            torch.index_select(host, 0, cols, out=out[: n * rows].view(n, rows))
            ms += (time.perf_counter() - t0) * 1e3
    return ms


def _move(model: Any, stay: float, topk: float, seed: int) -> dict:
    """``Selector._migrate`` of the selection (main thread), then its fill (a thread of its own,
    as the worker runs it), on state with rows and staging sizes / ``ROW_SCALE`` (module docstring)."""
    layout = _layout(model, topk, ROW_SCALE)
    cols, sel = _plan(layout, stay, seed)
    plan = plan_selection(layout, sel, [o for o, _ in cols], [n for _, n in cols])
    elems, ncols = sum(s.k * s.rows for s in sel), sum(s.k for s in sel)
    stage, sizing.STAGE_BYTES = sizing.STAGE_BYTES, sizing.STAGE_BYTES // ROW_SCALE
    try:
        mover = Mover(torch.device("cpu"), pin=False, ring=ring_elems(elems, ncols, max(s.rows for s in sel), 3),
                      out=out_elems(elems, 3, OUT_BYTES // ROW_SCALE), ids=4 * ncols)
        mover.ledger = ledger = Ledger()
        n, f32 = layout.dev_numel, torch.float32
        # ones, not zeros: pages touched before the clock
        dev = SimpleNamespace(master=torch.ones(n), exp_avg=torch.ones(n), exp_avg_sq=torch.ones(n),
                              steps=torch.ones(layout.dev_cols), grad=None)
        host: Any = SimpleNamespace(master=torch.ones(layout.host_numel, dtype=f32), exp_avg=torch.ones(layout.host_numel),
                                    exp_avg_sq=torch.ones(layout.host_numel), steps=torch.ones(layout.host_cols),
                                    upload=None, install_fence=None)
        host.column_state = lambda s: HostState.column_state(host, s)
        selector: Any = SimpleNamespace(mover=mover, departure=None, ledger=ledger, device=dev, landing=Departure())
        old_steps = torch.ones(sum(b.ncols for b in layout.blocks if not b.fixed))
        dev_ptrs = {_ptr(t) for t in (dev.master, dev.exp_avg, dev.exp_avg_sq, dev.steps)}
        host_ptrs = {_ptr(t) for t in (host.master, host.exp_avg, host.exp_avg_sq, host.steps)}

        def migrate() -> tuple[Any, Departure]:
            return Selector._migrate(selector, host, plan, old_steps, None)

        def counted(fn: Callable[[], Any]) -> tuple[Any, _Count]:
            with _Count(dev_ptrs, host_ptrs) as count:
                return fn(), count

        t0 = time.perf_counter()
        fill, dep = migrate()  # timed without the counting mode (its Python costs per op)
        ms = (time.perf_counter() - t0) * 1e3
        fill()
        dep.finish()
        tab = ledger.close()
        (fill, dep), main = counted(migrate)  # the same move again, counted: the same ops
        box: list[_Count] = []
        worker = threading.Thread(target=lambda: box.append(counted(fill)[1]))  # the worker's own dispatch modes
        worker.start()
        worker.join()
        dep.finish()
    finally:
        sizing.STAGE_BYTES = stage
    entering = 3 * sum(int(m.enter_cols.numel()) * m.slot.rows for m in plan.moves)
    ids = 8 * sum(int(t.numel()) for b in plan.blocks for t in (b.leave_pos, b.stay_src, b.stay_dst, b.enter_dst))
    h2d = tab.total("h2d.")
    return {"ms": ms, "gathered_share": main.gathered / entering if entering else 0.0,
            "views": main.views + box[0].views, "main_ops": main.device_ops, "main_gathers": main.gathers, "fill_ops": box[0].device_ops,
            "fill_gathers": box[0].gathers, "d2h": tab.total("d2h.") * ROW_SCALE,
            "h2d": ids + (h2d - ids) * ROW_SCALE, "host": tab.total("host.") * ROW_SCALE}
