"""The estimate's data: one line of the memory table (``MemoryItem``), the whole estimate
(``MemoryEstimate``), and the host bytes a list of lines holds.

Their own module so that the modules that make lines (lines.py, layouts.py), judge them
(verdict.py) and assemble them (memory.py) all import them and none imports another's names
back: lines.py asks verdict.py ``host_limit``, verdict.py judges ``MemoryItem`` lists, layouts.py
compares ``MemoryEstimate``s that memory.py builds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from zfctl.plan.machine import Machine
from zfctl.plan.sizes import ModelSize

# How the verdict's first reason opens when the process alone is more than the host may use: no
# model, and no change of the plan, fits (zfctl/plan/fit.py tries none; `zfctl plan` prints it alone).
NO_MODEL_FITS = "no model fits"


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


@dataclass
class MemoryEstimate:
    """The estimate: per-item bytes, totals, the machine, and a verdict with reasons."""

    size: ModelSize | None
    items: list[MemoryItem]
    device_total: float
    host_total: float
    device_kind: str  # "cuda" | "cpu": where the plan's device side would live
    machine: Machine
    fits: bool
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    accumulate: Literal["host", "device"] = "host"  # zenflow.accumulate as resolved for the machine
    strategy: Literal["zero2", "fsdp"] = "zero2"  # distributed.strategy as resolved (auto: module docstring)
    world_size: int = 1
    ranks_per_node: int = 1
    node_host_total: float = 0.0  # ranks_per_node x the per-rank host lines (and, without CUDA, device lines)
    host_accumulators: int = 1  # zenflow.tuning.host_accumulators as resolved for the machine
    upload_buffer: bool = False  # zenflow.tuning.upload_buffer as resolved (always False for fp32)
    grad_layout: Literal["slots", "carry"] = "slots"  # zenflow.tuning.grad_layout as resolved (layouts.py)
    staging_mb: float = 2048.0  # zenflow.tuning.staging_mb as resolved: the selection out buffer's cap, MiB
    resume_carry: float = 0.0  # slots: a resume inside an interval holds this fp32 carry for that interval (transient)

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["size"] is not None:  # the per-parameter shapes are an input, not a result
            d["size"].pop("shapes")
            d["size"].pop("vocab_names")
        return d

    @property
    def no_model_fits(self) -> str | None:
        """The reason no model fits the machine (the process alone is more than its host may
        use; no change of the plan helps), else None."""
        return next((r for r in self.reasons if r.startswith(NO_MODEL_FITS)), None)

    def item(self, name: str) -> float:
        """Bytes of the item called `name` (0 if absent)."""
        return sum(i.bytes for i in self.items if i.name == name)
