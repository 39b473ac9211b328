"""A selection's state migration on a GPU, with and without the page-locked staging (``pytest -m gpu
-s``): the same bits, and the staged one faster (selection.py ``Staging``).

Shapes: the embedding (by row) and two decoder layers of llama3.2-1b, a tenth of each matrix's
columns on the device, 90% of them replaced (what a 1B selection moved on an H200: 1.33 GB each
way). Prints the seconds and GB/s of both, for docs/design.md, "Performance model".
"""

from __future__ import annotations

import time

import pytest
import torch

from zfctl.offload.selection import ColumnState, Staging, migrate
from zfctl.offload.sizing import STAGE_BYTES

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
    return host, device, old.to(dev), new.to(dev)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_migration_is_exact_and_faster() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    cases = [_case(r, c, gen, dev) for r, c in SHAPES]
    stage = Staging(STAGE_BYTES // 4, pin=True, device=dev)
    results = {}
    for name, st in (("pageable", None), ("staged", stage), ("pageable", None), ("staged", stage)):
        runs = [([h.clone() for h in host], [d.clone() for d in device], old, new) for host, device, old, new in cases]
        torch.cuda.synchronize()
        t = time.perf_counter()
        moved = 0
        for host, device, old, new in runs:
            d2h, h2d = migrate(ColumnState(*device), host, old, new, st)
            moved += d2h + h2d
        torch.cuda.synchronize()
        results[name] = (time.perf_counter() - t, moved, runs)  # the second run of each counts
    (t_old, b_old, r_old), (t_new, b_new, r_new) = results["pageable"], results["staged"]
    print(f"\nmigration of {b_old / 1e9:.2f} GB (both ways): pageable {t_old:.3f} s ({b_old / t_old / 1e9:.1f} GB/s), "
          f"staged {t_new:.3f} s ({b_new / t_new / 1e9:.1f} GB/s)")
    assert b_old == b_new
    for (h0, d0, _, _), (h1, d1, _, _) in zip(r_old, r_new):
        assert all(torch.equal(a, b) for a, b in zip(h0 + d0, h1 + d1))
    assert t_new < t_old
