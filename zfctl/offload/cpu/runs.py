"""Element run lists: which parts of the flat host buffers one native call covers.

A run list is an int64 ``[n, 2]`` tensor of (offset, length), sorted by offset, runs disjoint
(``layout.column_runs`` builds them from column masks). The CPU AdamW is per element, so any cut of
a run list into parts, taken in any order, gives the same bits as one call over the whole list
(native/kernels.h): the CPU worker relies on that to update the entering columns of a selection
first (worker.py ``prioritize``) and to run an update piece by piece (``plan_pieces``).
"""

from __future__ import annotations

import numpy as np
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


def _sweep(a: torch.Tensor, b: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Both lists' edges in order, and the coverage after each: ``1`` where only ``a`` covers,
    ``2`` only ``b``, ``3`` both. Each list's edges (start, end, start, ...) are sorted already
    (sorted, disjoint runs), so the two are merged by rank, not sorted.
    Vectorised (no Python loop over runs: a selection's entering columns are ~10^5 runs at 1B
    parameters)."""
    an, bn = a.numpy(), b.numpy()  # numpy: its searchsorted and scatter are ~2x torch's here
    pa = np.stack([an[:, 0], an[:, 0] + an[:, 1]], axis=1).ravel()
    pb = np.stack([bn[:, 0], bn[:, 0] + bn[:, 1]], axis=1).ravel()
    # Merge ranks, ``a`` first on ties (the order within a tie only makes empty stretches): b's
    # edge j goes after the ``at[j]`` edges of a at or before it, and a's edge i after the edges
    # of b strictly before it, those with ``at[j] <= i``. One binary search, of b's edges only.
    at = np.searchsorted(pa, pb, side="right")
    rb = np.arange(pb.shape[0]) + at
    ra = np.arange(pa.shape[0]) + np.cumsum(np.bincount(at, minlength=pa.shape[0] + 1))[:-1]
    pos = np.empty(pa.shape[0] + pb.shape[0], dtype=np.int64)
    delta = np.empty_like(pos)
    pos[ra], pos[rb] = pa, pb
    delta[ra[0::2]], delta[ra[1::2]], delta[rb[0::2]], delta[rb[1::2]] = 1, -1, 2, -2
    return pos, np.cumsum(delta)


def _stretches(pos: np.ndarray, cover: np.ndarray, want: int) -> torch.Tensor:
    """Between edge i and edge i + 1 the coverage is cover[i]; ties give empty stretches, dropped.
    Stretches that touch are joined (the sweep cuts at every edge of the other list)."""
    length = pos[1:] - pos[:-1]
    keep = np.flatnonzero((cover[:-1] == want) & (length > 0))
    lo, hi = pos[keep], pos[keep + 1]
    if lo.shape[0] > 1:
        first = np.flatnonzero(np.concatenate([[True], lo[1:] != hi[:-1]]))
        last = np.concatenate([first[1:] - 1, [lo.shape[0] - 1]])
        lo, hi = lo[first], hi[last]
    return torch.from_numpy(np.stack([lo, hi - lo], axis=1).astype(np.int64, copy=False))


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
    runs = torch.cat(lists).numpy()  # numpy: its searchsorted and indexing are ~2x torch's here
    tag = np.repeat(np.arange(ngroups), [r.shape[0] for r in lists])
    bounds = np.asarray(pieces, dtype=np.int64).reshape(-1, 2)
    by_start = np.argsort(bounds[:, 0], kind="stable")
    p_lo, p_hi = bounds[by_start, 0], bounds[by_start, 0] + bounds[by_start, 1]
    edges = np.unique(np.concatenate([p_lo, p_hi]))  # sorted
    lo, hi = runs[:, 0], runs[:, 0] + runs[:, 1]
    a = np.searchsorted(edges, lo, side="right")  # edges[a:b] lie strictly inside (lo, hi)
    b = np.searchsorted(edges, hi, side="left")
    cnt = np.maximum(b - a, 0) + 1  # segments per run
    run = np.repeat(np.arange(runs.shape[0]), cnt)
    k = np.arange(run.shape[0]) - (np.cumsum(cnt) - cnt)[run]  # segment index within its run
    top = edges.shape[0] - 1
    pos_lo = np.where(k == 0, lo[run], edges[np.clip(a[run] + k - 1, 0, top)])
    pos_hi = np.where(k == cnt[run] - 1, hi[run], edges[np.clip(a[run] + k, 0, top)])
    # Each segment lies between two consecutive edges: inside one piece, or in no piece.
    at = np.searchsorted(p_lo, pos_lo, side="right") - 1
    keep = (at >= 0) & (pos_lo < p_hi[np.maximum(at, 0)])
    key = by_start[at[keep]] * ngroups + tag[run[keep]]
    order = np.argsort(key, kind="stable")  # stable: each list's own offset order within a piece
    seg = torch.from_numpy(np.stack([pos_lo[keep], pos_hi[keep] - pos_lo[keep]], axis=1)[order])
    counts = np.bincount(key, minlength=npieces * ngroups).tolist()
    parts = torch.split(seg, counts)
    return [[parts[j * ngroups + g].contiguous() for g in range(ngroups)] for j in range(npieces)]
