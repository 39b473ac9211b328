"""Host optimizer state keyed by parameter name and column range, so any world size can read it.

A data-parallel rank holds the host state of its own column ranges only (``partition``). Saved as
flat per-rank buffers, that state could only be loaded back by the same rank of the same world
size. Saved as *pieces* instead, one per (matrix, owned column range)::

    {"name": "model.layers.0.mlp.up_proj.weight", "c0": 0, "c1": 37,
     "master": [37, rows], "exp_avg": [37, rows], "exp_avg_sq": [37, rows],  # fp32, row = column
     "steps": [37],                                                          # per-column counters
     "acc": [37, rows]}                                                      # pipeline-owned

any rank of any world size can assemble its own cut from whichever pieces overlap it: every
quantity is per column (AdamW on the host is element-wise, the counters are per column, and
``acc``, the unfinished interval's fp32 gradient sum, is per element as well), so re-cutting
is copying rows. States written before the install read
the fp32 master also held ``upload`` (the pending update's values in the model dtype) while an
update waited to be installed; loading ignores it (the master holds the same values).

``owners`` says which saved ranks hold columns a new cut needs, so a resharding resume reads only
those files. Format 1 (flat per-rank buffers) is converted to pieces when it is loaded by the same
rank of the same world size; any other world size is refused (see ``state.check_state``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from zfctl.offload.cpu.host import fill
from zfctl.offload.layout import Layout

COLUMN_KEYS = ("steps",)  # one value per column; every other key holds ``rows`` values per column


def split_host(layout: Layout, flat: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """This rank's flat host buffers (as laid out by ``layout``) as name-keyed pieces (views)."""
    pieces = []
    for s in layout.host_slots:
        n = s.host_c1 - s.host_c0
        if n == 0:  # data parallel: none of this matrix's columns are ours
            continue
        piece: dict[str, Any] = {"name": s.name, "c0": s.host_c0, "c1": s.host_c1}
        for key, buf in flat.items():
            if key in COLUMN_KEYS:
                piece[key] = buf[s.host_col0 : s.host_col0 + n]
            else:
                piece[key] = s.host_view(buf)
        pieces.append(piece)
    return pieces


class LazyTensor(Protocol):
    """A tensor in a checkpoint file that is read only when copied somewhere (zfctl/train/
    tensorfile.py): what a resume loads a piece from, without a second copy in memory."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __getitem__(self, rows: slice) -> LazyTensor: ...

    def reshape(self, *shape: int) -> LazyTensor: ...

    def copy_to(self, dst: torch.Tensor) -> None: ...


def _keys(piece: dict[str, Any]) -> list[str]:
    return sorted(k for k in piece if k not in ("name", "c0", "c1"))


def check_covers(layout: Layout, pieces: list[dict[str, Any]]) -> None:
    """Raise ValueError, before anything is modified, when a column this rank owns is in no piece,
    or a piece does not fit the matrix of its name."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for p in pieces:
        by_name.setdefault(p["name"], []).append(p)
    keys = _keys(pieces[0]) if pieces else []
    for s in layout.host_slots:
        n = s.host_c1 - s.host_c0
        if n == 0:
            continue
        seen = torch.zeros(n, dtype=torch.bool)
        for p in by_name.get(s.name, []):
            a, b = max(p["c0"], s.host_c0), min(p["c1"], s.host_c1)
            if a >= b:
                continue
            if _keys(p) != keys:
                raise ValueError(f"optimizer state pieces of {s.name!r} hold different buffers")
            if p[keys[0]].shape[0] != p["c1"] - p["c0"] or any(
                    tuple(p[k].shape[1:]) != (s.rows,) for k in keys if k not in COLUMN_KEYS):
                raise ValueError(f"optimizer state piece of {s.name!r} columns [{p['c0']}, {p['c1']}) does not "
                                 f"fit a matrix of {s.rows} rows")
            seen[a - s.host_c0 : b - s.host_c0] = True
        if not bool(seen.all()):
            have = sorted((p["c0"], p["c1"]) for p in by_name.get(s.name, []))
            raise ValueError(f"optimizer state lacks columns of {s.name!r}: this process holds "
                             f"[{s.host_c0}, {s.host_c1}), the pieces given cover {have}")


def gather_host(layout: Layout, pieces: list[dict[str, Any]],
                into: dict[str, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
    """Copy this rank's columns from ``pieces`` of any cut (any world size) straight into the flat
    buffers ``into`` (laid out by ``layout``; host tensors, or the device path's device sum), one
    overlapping column range at a time: no gathered copy of the state. Keys of the pieces that
    ``into`` lacks or maps to None are skipped (``upload``, held by states written before the
    install read the master). Call :func:`check_covers` first. Without ``into``: checks, then fills
    new zero buffers (tests, tools); returns the buffers filled."""
    if into is None:
        check_covers(layout, pieces)
        keys = _keys(pieces[0]) if pieces else []
        into = {k: torch.zeros(layout.host_cols if k in COLUMN_KEYS else layout.host_numel, dtype=pieces[0][k].dtype)
                for k in keys}
    by_name: dict[str, list[dict[str, Any]]] = {}
    for p in pieces:
        by_name.setdefault(p["name"], []).append(p)
    for s in layout.host_slots:
        for p in by_name.get(s.name, []):
            a, b = max(p["c0"], s.host_c0), min(p["c1"], s.host_c1)
            if a >= b:
                continue
            lo, hi = a - s.host_c0, b - s.host_c0  # in this rank's range
            for k in _keys(p):
                dst = into.get(k)
                if dst is None:
                    continue
                src = p[k][a - p["c0"] : b - p["c0"]]
                if k in COLUMN_KEYS:
                    fill(dst[s.host_col0 + lo : s.host_col0 + hi], src)
                else:
                    fill(dst[s.host_off + lo * s.rows : s.host_off + hi * s.rows], src.reshape(-1))
    return {k: v for k, v in into.items() if v is not None}


def owned_ranges(layout: Layout) -> list[tuple[str, int, int]]:
    """(name, c0, c1) of every host column range this optimizer holds (empty ranges left out)."""
    return [(s.name, s.host_c0, s.host_c1) for s in layout.host_slots if s.host_c1 > s.host_c0]


def owners(saved_ranges: list[list[Any]], wanted: list[tuple[str, int, int]]) -> list[int]:
    """The saved ranks whose pieces overlap ``wanted``.

    ``saved_ranges``: ``[name, owner, c0, c1]`` for every piece of every saved rank (the
    ``ranges`` entry of a state dict's ``partition``, the same in every rank's file).
    """
    need = set()
    for name, owner, c0, c1 in saved_ranges:
        if any(n == name and max(c0, a) < min(c1, b) for n, a, b in wanted):
            need.add(int(owner))
    return sorted(need)


def merge_states(states: list[dict[str, Any]], wanted: list[tuple[str, int, int]]) -> dict[str, Any]:
    """One state dict for an optimizer holding ``wanted``: the replicated part of ``states[0]`` and
    the pieces of all ``states`` (saved ranks' dicts, format 2) that overlap ``wanted``."""
    if any(st.get("host") is not None and not isinstance(st["host"], list) for st in states):
        raise ValueError("optimizer state of format 1 (flat per-rank buffers) cannot be re-cut")
    pieces = [p for st in states for p in st.get("host") or []
              if any(n == p["name"] and max(p["c0"], a) < min(p["c1"], b) for n, a, b in wanted)]
    return {**states[0], "host": pieces if states[0].get("host") is not None else None}
