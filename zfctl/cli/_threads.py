"""``OMP_NUM_THREADS`` checked before torch loads: libgomp reads it once, when torch loads it, and
prints a raw ``libgomp: Invalid value for environment variable OMP_NUM_THREADS`` line for a value
that is not a thread count (empty, ``abc``, ``0``), then uses its default. The CLI entry
(:func:`zfctl.cli.main`) removes such a value first, so libgomp, torch, the native CPU AdamW
(native/pool.c) and every process zfctl starts (torchrun's ranks inherit the environment) see it
unset, and prints one ``note:`` line instead; ``zfctl doctor`` shows the value and the counts used.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OMP = "OMP_NUM_THREADS"
# The value the user gave when the CLI entry removed it (None: nothing was removed).
_removed: str | None = None


def is_thread_count(value: str) -> bool:
    """Whether libgomp takes ``value``: positive integers, comma-separated (one per nesting
    level), spaces around each allowed."""
    parts = [p.strip() for p in value.split(",")]
    return all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts)


def drop_bad_omp_threads(env: MutableMapping[str, str] | None = None) -> str | None:
    """Remove an ``OMP_NUM_THREADS`` that is not a thread count from ``env`` (default: this
    process's environment, whose value :func:`given_omp_threads` then remembers); returns the note
    that says so, None when the value is fine or unset."""
    global _removed
    mine = env is None
    env = os.environ if env is None else env
    value = env.get(OMP)
    if value is None or is_thread_count(value):
        return None
    del env[OMP]
    if mine:
        _removed = value
    return (f"{OMP}={value!r} is not a thread count (a positive integer); ignored, as if unset: torch and the "
            "CPU AdamW use their default thread counts (zfctl doctor shows them)")


def given_omp_threads() -> str | None:
    """The ``OMP_NUM_THREADS`` the user gave: the one the CLI entry removed, else the environment's."""
    return _removed if _removed is not None else os.environ.get(OMP)
