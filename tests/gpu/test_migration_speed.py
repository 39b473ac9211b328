"""A selection's state migration on a GPU: the blocking one (selection.py ``migrate``, what
data-parallel ranks keep) against the asynchronous one (migration.py ``Mover``), ``pytest -m gpu
-s``: the same bits, the asynchronous one faster, and its training-thread waits only the listed
ones.

Shapes: the embedding (by row) and two decoder layers of llama3.2-1b, a tenth of each matrix's
columns on the device, 90% of them replaced (what a 1B selection moved on an H200: 1.33 GB each
way). Prints the seconds and GB/s of both, for docs/design.md, "Performance model".
"""

from __future__ import annotations

import time

import pytest
import torch

from zfctl.offload import sizing
from zfctl.offload.columns import migration
from zfctl.offload.columns.departure import Pair
from zfctl.offload.columns.groups import Group
from zfctl.offload.columns.selection import ColumnState, migrate, plan_selection
from zfctl.offload.layout import plan_layout
from zfctl.offload.ledger import Ledger

pytestmark = pytest.mark.gpu
LAYER = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
SHAPES = [(2048, 128256)] + LAYER * 2  # (rows, cols) of each matrix


def _state(layout, gen: torch.Generator, dev: torch.device):
    """Host state (flat, column-major) and device state (flat, block rows) of ``layout``."""
    host = [torch.empty(layout.host_numel).uniform_(generator=gen) for _ in range(3)] + [torch.ones(layout.host_cols)]
    device = [torch.rand(layout.dev_numel, generator=gen).to(dev) for _ in range(3)]
    return host, device + [torch.full((layout.dev_cols,), 5.0, device=dev)]


def _sets(slot, gen: torch.Generator):
    perm = torch.randperm(slot.cols, generator=gen)
    k = slot.k
    old = perm[:k].sort().values
    return old, torch.cat([perm[: k // 10], perm[k : 2 * k - k // 10]]).sort().values  # 10% stay


def _views(slot, host, device):
    """One matrix's (device ColumnState, host rows) views, as DeviceAdam and HostState give them."""
    n = slot.k * slot.rows
    dev = [d[slot.dev_off : slot.dev_off + n].view(slot.k, slot.rows) for d in device[:3]]
    hst = [slot.host_view(h) for h in host[:3]]
    cols = host[3][slot.host_col0 : slot.host_col0 + slot.cols]
    return ColumnState(*dev, device[3][slot.dev_col0 : slot.dev_col0 + slot.k]), hst + [cols]


def _groups(plan, host, device, dep):
    """Selector._migrate's groups, the step counters' leaving rows written by the departure too."""
    groups = []
    for b in plan.blocks:
        blk = b.block
        for d, h in zip(device[:3], host[:3]):
            rows = d[blk.off : blk.off + blk.ncols * blk.length].view(blk.ncols, blk.length)
            groups.append(Group(rows, b, tuple(Pair(m.slot.host_view(h), dep) for m in b.moves)))
        steps = device[3][blk.col0 : blk.col0 + blk.ncols].view(-1, 1)
        groups.append(Group(steps, b, tuple(
            Pair(host[3][m.slot.host_col0 : m.slot.host_col0 + m.slot.cols].view(-1, 1), dep) for m in b.moves)))
    return groups


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_asynchronous_migration_is_exact_and_faster() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    layout = plan_layout([(f"m{i}", torch.empty(r, c, device="meta")) for i, (r, c) in enumerate(SHAPES)], 0.1)
    sel = [s for s in layout.slots if s.selects]
    sets = [_sets(s, gen) for s in sel]
    host0, device0 = _state(layout, gen, dev)
    elems, cols = sum(s.k * s.rows for s in sel), sum(s.k for s in sel)
    mover = migration.Mover(dev, pin=True, ring=sizing.ring_elems(elems, cols, max(s.rows for s in sel)),
                            out=sizing.out_elems(elems), ids=4 * cols)
    results = {}
    for name in ("blocking", "async", "blocking", "async"):
        host, device = [h.clone() for h in host0], [d.clone() for d in device0]
        torch.cuda.synchronize()
        t = time.perf_counter()
        moved, enqueued, filled = 0, 0.0, 0.0
        if name == "blocking":
            for slot, (old, new) in zip(sel, sets):
                d, h = _views(slot, host, device)
                d2h, h2d = migrate(d, h, old.to(dev), new.to(dev))
                moved += d2h + h2d
        else:
            dep = migration.Departure()
            plan = plan_selection(layout, sel, [o for o, _ in sets], [n for _, n in sets])
            mover.ledger = ledger = Ledger()
            fill = mover.move(_groups(plan, host, device, dep))
            enqueued = time.perf_counter() - t  # the training thread's share: planning and enqueueing
            assert fill is not None
            fill()  # the worker's share in the engine, after the priority update (worker.py)
            filled = time.perf_counter() - t - enqueued
            mover.join()
            dep.finish()  # the worker's share in the engine (behind the CPU update)
            tab = ledger.close()
            moved += tab.total("d2h.") + tab.total("h2d.")
        torch.cuda.synchronize()
        results[name] = (time.perf_counter() - t, moved, (host, device), enqueued, filled)  # the second run of each counts
    (t_old, b_old, r_old, _, _), (t_new, b_new, r_new, t_enq, t_fill) = results["blocking"], results["async"]
    print(f"\nmigration of {b_old / 1e9:.2f} GB (both ways): blocking {t_old:.3f} s ({b_old / t_old / 1e9:.1f} GB/s), "
          f"asynchronous {t_new:.3f} s ({b_new / t_new / 1e9:.1f} GB/s; the training thread {t_enq:.3f} s, "
          f"the fill {t_fill:.3f} s, {mover.slot_waits} in-ring waits)")
    assert abs(b_new - b_old) <= 8 * 4 * cols  # plus the ids
    for a, b in zip(r_old[0] + r_old[1], r_new[0] + r_new[1]):
        assert torch.equal(a, b)
    assert t_new < t_old
    mover.release()
