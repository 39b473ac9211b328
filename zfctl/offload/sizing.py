"""The engine's size rules that the run plan applies too, as pure arithmetic without torch.

zfctl/plan/memory.py sizes every buffer the engine allocates with the engine's own rules, so the
plan and the run cannot disagree. Those rules used to live next to the torch code that applies
them (bandwidth.py, device_acc.py, device_to_host.py, layout.py, ring.py, migration.py and
zfctl/train/checksum.py), which
made `zfctl plan` import torch (about 2 s of a 2-core machine) to do a few multiplications. They
live here now and those modules import them from here; nothing here may import
torch (tests/cli/test_light_verbs.py runs `zfctl plan` and checks that torch stays unloaded).
"""

from __future__ import annotations

import math

# --- bandwidth.py: gradient bytes the hook path keeps in flight to the host ---------------------
WINDOW_MS = 2.0  # copy time the in-flight bytes should cover
MIN_BYTES = 16 * 2**20  # below this a hook waits on nearly every large matrix
MAX_BYTES = 1024 * 2**20  # device memory held by temporaries, whatever the link


def inflight_bytes(gbps: float, *, window_ms: float = WINDOW_MS, lo: int = MIN_BYTES,
                   hi: int = MAX_BYTES) -> int:
    """Bytes that ``window_ms`` of copy at ``gbps`` (1e9 B/s) moves, clamped to ``[lo, hi]``.

    A pure function of its arguments; a non-positive or non-finite rate gives ``lo``.
    """
    if lo > hi:
        raise ValueError(f"inflight_bytes: lo ({lo}) > hi ({hi})")
    if not gbps > 0 or gbps == float("inf"):
        return lo
    return int(min(hi, max(lo, gbps * 1e9 * window_ms / 1e3)))


# --- device_acc.py: `accumulate: auto` ------------------------------------------------------------
# `accumulate: auto`'s rule (device_fits): what the device holds anyway plus the accumulator within
# this share of its memory. The margin is wide because a plan's activation estimate is rough.
AUTO_DEVICE_SHARE = 0.85


def device_fits(committed_bytes: float, acc_bytes: float, total_bytes: float) -> bool:
    """``accumulate: auto``'s one rule: the device accumulator (``acc_bytes``) is used when it and
    everything else the device holds for the run (``committed_bytes``) stay within
    ``AUTO_DEVICE_SHARE`` of the device's memory (``total_bytes``). Pure arithmetic: the run
    plan passes its estimate (zfctl/plan/memory.py)."""
    return committed_bytes + acc_bytes <= AUTO_DEVICE_SHARE * total_bytes


# --- device_to_host.py: the gradient slots of a set -----------------------------------------------
def slots_per_set(update_interval: int | str, auto_max_interval: int) -> int:
    """Slots in a set (slots.py): one per step of the longest interval (``update_interval``, or
    under ``auto`` its bound ``tuning.auto_max_interval``, which a full set enforces:
    Pipeline.close_step)."""
    return auto_max_interval if update_interval == "auto" else int(update_interval)


# --- layout.py: how many columns of a matrix stay on the device -----------------------------------
def num_selected(cols: int, topk_ratio: float) -> int:
    """Columns of a matrix kept on the device: 0 for r=0, all for r=1, else max(1, floor(r*cols))."""
    if topk_ratio <= 0.0:
        return 0
    if topk_ratio >= 1.0:
        return cols
    return min(cols, max(1, math.floor(topk_ratio * cols)))


# --- ring.py: the D2H transfer ring's slots -------------------------------------------------------
def ring_slot_bytes(want: int, nslots: int, max_rows: int, host_numel: int, itemsize: int) -> int:
    """Bytes per slot: ``want`` (zenflow.tuning.ring_slot_mb), but no more than the slots need to hold
    the whole host-path gradient (a small model's ring stays small), and at least one column of
    the tallest matrix; a multiple of 64 bytes, so every dtype view of a slot is aligned."""
    need = -(-host_numel * itemsize // nslots)
    size = max(min(want, need), max_rows * itemsize)
    return -(-size // 64) * 64


def carry_host_bytes(host_numel: int, ring_slots: int, slot_bytes: int) -> int:
    """Host bytes of the carry gradient layout (carry.py; both page-locked on CUDA): the fp32
    carry, 4 B per host element, plus the landing ring, ``ring_slots`` slots of ``slot_bytes``
    (``ring_slot_bytes``: one D2H ring slot each). The slots layout's counterpart is
    ``slots_per_set x sets x itemsize`` per host element."""
    return 4 * host_numel + ring_slots * slot_bytes


# --- migration.py: a selection's column migration ------------------------------------------------
STAGE_BYTES = 64 * 2**20  # one packed DMA (each way), and one in-ring slot
IN_SLOTS = 4  # in-ring slots: the host gathers slot i + 1 while the link moves slot i
# The out buffer's largest cap: a 1.24B model's leaving state (1.48 GB at most) fits. The plan
# caps it lower where the host has less to spare (zenflow.tuning.staging_mb, zfctl/plan/layouts.py
# ``staging_cap``); never below one packed piece (STAGE_BYTES), so a piece always has a place.
OUT_BYTES = 2 * 2**30


def staging_bytes(selected_elems: int, selected_cols: int, max_rows: int, pairs: int = 3,
                  cap: int = OUT_BYTES) -> int:
    """Host bytes of a migration.py ``Mover`` for matrices with ``selected_elems`` device elements
    in ``selected_cols`` columns (the tallest ``max_rows``), ``pairs`` state tensors of ``rows``
    elements per column moved (3: master and moments; 4 with release.py's gradient), its out
    buffer capped at ``cap`` bytes: the in ring, the out buffer and the ids buffer
    (zfctl/plan/lines.py's "selection staging")."""
    ring, out = ring_elems(selected_elems, selected_cols, max_rows, pairs), out_elems(selected_elems, pairs, cap)
    return 4 * (ring + out) + 8 * 4 * selected_cols


def ring_elems(selected_elems: int, selected_cols: int, max_rows: int, pairs: int = 3) -> int:
    """The in ring: ``IN_SLOTS`` slots of ``STAGE_BYTES``, each at least one column of the tallest
    matrix, together no more than a selection that replaces every column brings in plus one
    column per slot: slots are filled with whole rows, so each may leave less than a row unused,
    and a selection that fits reuses no slot (no host wait)."""
    total = pairs * selected_elems + selected_cols
    return IN_SLOTS * max(min(STAGE_BYTES // 4, -(-total // IN_SLOTS) + max_rows), max_rows)


def out_elems(selected_elems: int, pairs: int = 3, cap: int = OUT_BYTES) -> int:
    """The out buffer: every leaving row of one selection (all ``k`` columns leave), at most
    ``cap`` bytes (zenflow.tuning.staging_mb) and never less than one packed piece
    (``STAGE_BYTES``): the rows beyond it wait for the buffer to drain (migration.py ``_make_room``)."""
    return min(max(cap, STAGE_BYTES) // 4, pairs * selected_elems)


def staging_cap(staging_mb: float | str) -> int:
    """The out buffer's cap in bytes for ``zenflow.tuning.staging_mb``: ``auto`` (a config no plan
    settled: a library user's) is ``OUT_BYTES``."""
    return OUT_BYTES if staging_mb == "auto" else int(float(staging_mb) * 2**20)


# --- zfctl/train/checksum.py: checkpoint streaming -------------------------------------------------
# Device tensors reach a checkpoint through one host chunk of this size at a time (the plan's
# "checkpoint I/O" line); host tensors are written from their own memory. It sits in this module,
# below train/, because the plan must read it without the torch that checksum.py imports.
CHUNK_BYTES = 64 * 2**20
