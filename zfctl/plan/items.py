"""One line of the plan's memory table, and the host bytes a list of lines holds.

Its own module so that the lines (lines.py, layouts.py) and the verdict (verdict.py) both import
it and neither imports the other's names back (lines.py asks verdict.py ``host_limit``;
verdict.py judges ``MemoryItem`` lists).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryItem:
    where: str  # "device" | "host"
    name: str
    bytes: float
    note: str = ""
    code: str = ""  # what allocates it


def host_held(items: list[MemoryItem], device_kind: str) -> float:
    """Host bytes of ``items`` as the verdict counts one rank: the host lines, and without CUDA
    the device lines too (the device side is host RAM then)."""
    return sum(i.bytes for i in items if i.where == "host" or device_kind == "cpu")
