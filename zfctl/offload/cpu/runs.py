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


def _combine(a: torch.Tensor, b: torch.Tensor, want: int) -> torch.Tensor:
    """A sweep over both lists' edges: coverage ``1`` where only ``a`` covers, ``2`` only ``b``,
    ``3`` both; the stretches whose coverage is ``want``. Vectorised (no Python loop over runs:
    a selection's entering columns are ~10^5 runs at 1B parameters)."""
    if a.shape[0] == 0 or (b.shape[0] == 0 and want == 3):
        return a[:0]
    if b.shape[0] == 0:
        return a
    pos = torch.cat([a[:, 0], a[:, 0] + a[:, 1], b[:, 0], b[:, 0] + b[:, 1]])
    na, nb = a.shape[0], b.shape[0]
    delta = torch.cat([torch.ones(na, dtype=torch.int64), -torch.ones(na, dtype=torch.int64),
                       torch.full((nb,), 2, dtype=torch.int64), torch.full((nb,), -2, dtype=torch.int64)])
    order = torch.argsort(pos, stable=True)
    pos, cover = pos[order], torch.cumsum(delta[order], 0)
    # Between edge i and edge i + 1 the coverage is cover[i]; ties give empty stretches, dropped.
    length = pos[1:] - pos[:-1]
    keep = (cover[:-1] == want) & (length > 0)
    out = torch.stack([pos[:-1][keep], length[keep]], dim=1)
    return _merge(out)


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
