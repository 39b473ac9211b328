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
from zfctl.offload.columns.selection import ColumnState, migrate, plan_moves

pytestmark = pytest.mark.gpu
LAYER = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
SHAPES = [(2048, 128256)] + LAYER * 2  # (rows, cols) of each matrix


def _case(rows: int, cols: int, gen: torch.Generator, dev: torch.device):
    k = cols // 10
    perm = torch.randperm(cols, generator=gen)
    old = perm[:k].sort().values
    new = torch.cat([perm[: k // 10], perm[k : 2 * k - k // 10]]).sort().values  # 10% stay
    host = [torch.empty(cols, rows).uniform_() for _ in range(3)] + [torch.ones(cols)]
    device = [torch.rand(k, rows, device=dev) for _ in range(3)] + [torch.full((k,), 5.0, device=dev)]
    return host, device, old, new


def _mover(cases, dev: torch.device) -> migration.Mover:
    elems = sum(d[0].numel() for _, d, _, _ in cases)
    cols = sum(d[3].numel() for _, d, _, _ in cases)
    rows = max(d[0].shape[1] for _, d, _, _ in cases)
    return migration.Mover(dev, pin=True, ring=sizing.ring_elems(elems, cols, rows),
                           out=sizing.out_elems(elems), ids=4 * cols)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_asynchronous_migration_is_exact_and_faster() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    cases = [_case(r, c, gen, dev) for r, c in SHAPES]
    mover = _mover(cases, dev)
    results = {}
    for name in ("blocking", "async", "blocking", "async"):
        runs = [([h.clone() for h in host], [d.clone() for d in device], old, new) for host, device, old, new in cases]
        torch.cuda.synchronize()
        t = time.perf_counter()
        moved, enqueued = 0, 0.0
        if name == "blocking":
            for host, device, old, new in runs:
                d2h, h2d = migrate(ColumnState(*device), host, old.to(dev), new.to(dev))
                moved += d2h + h2d
        else:
            dep, jobs = migration.Departure(), []
            for i, (host, device, old, new) in enumerate(runs):
                slot = type("Slot", (), {"index": i})()
                pairs = [migration.Pair(d.view(d.shape[0], -1), h.view(h.shape[0], -1), dep) for d, h in zip(device, host)]
                jobs.append((plan_moves(slot, old, new), pairs))
            d2h, h2d = mover.move(jobs)
            enqueued = time.perf_counter() - t  # the training thread's share: gathers and enqueueing
            dep.finish()  # the worker's share in the engine (behind the CPU update)
            moved += d2h + h2d
        torch.cuda.synchronize()
        results[name] = (time.perf_counter() - t, moved, runs, enqueued)  # the second run of each counts
    (t_old, b_old, r_old, _), (t_new, b_new, r_new, t_enq) = results["blocking"], results["async"]
    print(f"\nmigration of {b_old / 1e9:.2f} GB (both ways): blocking {t_old:.3f} s ({b_old / t_old / 1e9:.1f} GB/s), "
          f"asynchronous {t_new:.3f} s ({b_new / t_new / 1e9:.1f} GB/s; the training thread {t_enq:.3f} s, "
          f"{mover.host_waits} in-ring waits)")
    assert abs(b_new - b_old) <= 8 * 4 * sum(len(n) for _, _, _, n in cases)  # plus the ids
    for (h0, d0, _, _), (h1, d1, _, _) in zip(r_old, r_new):
        assert all(torch.equal(a, b) for a, b in zip(h0 + d0, h1 + d1))
    assert t_new < t_old
    mover.release()
