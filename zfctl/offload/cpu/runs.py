"""Element run lists: which parts of the flat host buffers one native call covers.

A run list is an int64 ``[n, 2]`` tensor of (offset, length), sorted by offset, runs disjoint
(``layout.column_runs`` builds them from column masks). The CPU AdamW is per element, so any cut of
a run list into parts, taken in any order, gives the same bits as one call over the whole list
(native/kernels.h): the CPU worker relies on that to update the entering columns of a selection
first (worker.py ``prioritize``) and to run an update piece by piece (``plan_pieces``).
"""

from __future__ import annotations

import torch

PIECE_ELEMS = 16 * 2**20  # elements per piece of an update: ~450 MB of AdamW traffic, a few ms on 16 threads


def runs_and(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The elements in both run lists, as a run list."""
    return _combine(a, b, 3)


def runs_minus(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The elements of ``a`` that are not in ``b``, as a run list."""
    return _combine(a, b, 1)


def runs_and_minus(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(runs_and(a, b), runs_minus(a, b))`` from one sweep (a priority request splits each
    counter group's runs into entering and remaining: worker.py ``CpuWorker._serve``)."""
    if a.shape[0] == 0:
        return a[:0], a
    if b.shape[0] == 0:
        return a[:0], a
    pos, cover = _sweep(a, b)
    return _stretches(pos, cover, 3), _stretches(pos, cover, 1)


def _combine(a: torch.Tensor, b: torch.Tensor, want: int) -> torch.Tensor:
    """The stretches of the sweep over both lists whose coverage is ``want`` (``_sweep``)."""
    if a.shape[0] == 0 or (b.shape[0] == 0 and want == 3):
        return a[:0]
    if b.shape[0] == 0:
        return a
    return _stretches(*_sweep(a, b), want)


def _sweep(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both lists' edges in order, and the coverage after each: ``1`` where only ``a`` covers,
    ``2`` only ``b``, ``3`` both. Each list's edges (start, end, start, ...) are sorted already
    (sorted, disjoint runs), so the two are merged by rank, not sorted.
    Vectorised (no Python loop over runs: a selection's entering columns are ~10^5 runs at 1B
    parameters)."""
    pa = torch.stack([a[:, 0], a[:, 0] + a[:, 1]], dim=1).flatten()
    pb = torch.stack([b[:, 0], b[:, 0] + b[:, 1]], dim=1).flatten()
    da = torch.tensor([1, -1], dtype=torch.int64).repeat(a.shape[0])
    db = torch.tensor([2, -2], dtype=torch.int64).repeat(b.shape[0])
    # Merge ranks, ``a`` first on ties (the order within a tie only makes empty stretches): b's
    # edge j goes after the ``at[j]`` edges of a at or before it, and a's edge i after the edges
    # of b strictly before it, those with ``at[j] <= i``. One binary search, of b's edges only.
    at = torch.searchsorted(pa, pb, right=True)
    rb = torch.arange(pb.shape[0]) + at
    ra = torch.arange(pa.shape[0]) + torch.cumsum(torch.bincount(at, minlength=pa.shape[0] + 1), 0)[:-1]
    pos = torch.empty(pa.shape[0] + pb.shape[0], dtype=torch.int64)
    delta = torch.empty_like(pos)
    pos[ra], pos[rb], delta[ra], delta[rb] = pa, pb, da, db
    return pos, torch.cumsum(delta, 0)


def _stretches(pos: torch.Tensor, cover: torch.Tensor, want: int) -> torch.Tensor:
    """Between edge i and edge i + 1 the coverage is cover[i]; ties give empty stretches, dropped."""
    length = pos[1:] - pos[:-1]
    keep = (cover[:-1] == want) & (length > 0)
    return _merge(torch.stack([pos[:-1][keep], length[keep]], dim=1))


def _merge(runs: torch.Tensor) -> torch.Tensor:
    """Join runs that touch (the sweep cuts at every edge of the other list)."""
    if runs.shape[0] < 2:
        return runs.contiguous()
    ends = runs[:, 0] + runs[:, 1]
    starts_new = torch.ones(runs.shape[0], dtype=torch.bool)
    starts_new[1:] = runs[1:, 0] != ends[:-1]
    first = torch.nonzero(starts_new).flatten()
    last = torch.cat([first[1:] - 1, torch.tensor([runs.shape[0] - 1])])
    return torch.stack([runs[first, 0], ends[last] - runs[first, 0]], dim=1).contiguous()


def plan_pieces(ranges: list[tuple[int, int]], limit: int | None = None) -> list[tuple[int, int]]:
    """``(offset, elements)`` ranges cut into pieces of at most ``limit`` (``PIECE_ELEMS``)
    elements, in order."""
    limit = limit or PIECE_ELEMS
    out = []
    for off, n in ranges:
        for a in range(0, n, limit):
            out.append((off + a, min(limit, n - a)))
    return out


def cut_runs(lists: list[torch.Tensor], pieces: list[tuple[int, int]]) -> list[list[torch.Tensor]]:
    """Each run list of ``lists`` cut to every piece of ``pieces`` (disjoint ``(offset, elements)``
    ranges, in any order) at once: ``out[j][g]`` is the part of ``lists[g]`` inside ``pieces[j]``,
    sorted by offset; elements outside every piece are dropped. One ``searchsorted`` of all runs'
    starts and ends against the sorted piece edges (no loop over runs or pieces): a priority
    request cuts ~10^5 runs to ~10^2 pieces (worker.py ``CpuWorker._serve``)."""
    npieces, ngroups = len(pieces), len(lists)
    if npieces == 0 or ngroups == 0:
        return [[] for _ in range(npieces)] if ngroups == 0 else []
    runs = torch.cat(lists)
    tag = torch.repeat_interleave(torch.arange(ngroups), torch.tensor([r.shape[0] for r in lists], dtype=torch.int64))
    bounds = torch.tensor(pieces, dtype=torch.int64).reshape(-1, 2)
    by_start = torch.argsort(bounds[:, 0])
    p_lo, p_hi = bounds[by_start, 0], bounds[by_start, 0] + bounds[by_start, 1]
    edges = torch.unique(torch.cat([p_lo, p_hi]))  # sorted
    lo, hi = runs[:, 0].contiguous(), (runs[:, 0] + runs[:, 1]).contiguous()
    a = torch.searchsorted(edges, lo, right=True)  # edges[a:b] lie strictly inside (lo, hi)
    b = torch.searchsorted(edges, hi, right=False)
    cnt = (b - a).clamp(min=0) + 1  # segments per run
    first = torch.cumsum(cnt, 0) - cnt
    run = torch.repeat_interleave(torch.arange(runs.shape[0]), cnt)
    k = torch.arange(run.shape[0]) - first[run]  # segment index within its run
    top = edges.shape[0] - 1
    pos_lo = torch.where(k == 0, lo[run], edges[(a[run] + k - 1).clamp(0, top)])
    pos_hi = torch.where(k == cnt[run] - 1, hi[run], edges[(a[run] + k).clamp(0, top)])
    # Each segment lies between two consecutive edges: inside one piece, or in no piece.
    at = torch.searchsorted(p_lo, pos_lo, right=True) - 1
    keep = (at >= 0) & (pos_lo < p_hi[at.clamp(min=0)])
    piece = by_start[at[keep].clamp(min=0)]
    key = piece * ngroups + tag[run[keep]]
    order = torch.argsort(key, stable=True)  # stable: each list's own offset order within a piece
    seg = torch.stack([pos_lo[keep], pos_hi[keep] - pos_lo[keep]], dim=1)[order]
    counts = torch.bincount(key, minlength=npieces * ngroups).tolist()
    parts = torch.split(seg, counts)
    return [[parts[j * ngroups + g].contiguous() for g in range(ngroups)] for j in range(npieces)]
