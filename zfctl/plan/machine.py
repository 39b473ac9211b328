"""The machine a plan is checked against: this one, or the sizes the plan's `machine` section names.

`--gpu-memory 80GB` / `--host-memory 128GB` (`machine.gpu_memory`, `machine.host_memory`) let a
laptop plan the GPU run; without them the detected host RAM and first CUDA device count. They
change the verdict only: a run resolves ``accumulate: auto`` against :func:`this_machine`
(train/optim.py ``run_accumulate``). Sizes
are decimal GB (1e9 bytes), as GPU vendors and the ZenFlow paper quote them; the binary units
are accepted too.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from zfctl.errors import UserError
from zfctl.gpu_probe import no_cuda_reason
from zfctl.plan.schema import MachineConfig

GB = 1e9
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MAX_SIZE = 1e15  # 1 PB: no GPU or host has more; a larger size is a slip of the unit or an overflow


@dataclass
class Machine:
    host_ram: float
    cuda: bool
    gpu_name: str = ""
    gpu_mem: float = 0.0


def parse_size(text: str | float, what: str) -> float:
    """Bytes of a size like ``80GB``, ``128 GiB`` or ``1.5TB``; UserError naming ``what`` otherwise.

    A size must be a finite, positive number up to ``MAX_SIZE``: ``1e400GB`` overflows a float to
    inf, which would make every plan "fit"; anything above a petabyte is a typo, not a machine.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise UserError(f"{what} {text!r}: not a size; give a number with a unit, e.g. 80GB or 128GiB "
                        "(B, KB, MB, GB, TB decimal; KiB, MiB, GiB, TiB binary)")
    value = float(m.group(1)) * _UNITS[unit]
    if not value > 0:
        raise UserError(f"{what} {text!r}: must be positive, e.g. 80GB")
    if not math.isfinite(value) or value > MAX_SIZE:
        raise UserError(f"{what} {text!r}: larger than any machine (at most {MAX_SIZE / 1e15:g} PB); "
                        "give the memory in GB, e.g. 80GB")
    return value


def this_machine() -> Machine:
    """Host RAM and the first CUDA device, if any."""
    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 0.0
    if no_cuda_reason() is not None:  # no GPU driver: torch (~2 s to import) could only say "no CUDA"
        return Machine(ram, False)
    import torch

    try:
        if torch.cuda.is_available():
            prop = torch.cuda.get_device_properties(0)
            return Machine(ram, True, prop.name, float(prop.total_memory))
    except RuntimeError as e:  # a broken CUDA driver must not break `zfctl plan`
        return Machine(ram, False, gpu_name=f"CUDA error: {e}")
    return Machine(ram, False)


def target_machine(t: MachineConfig) -> Machine:
    """This machine, with the sizes the plan's ``machine`` section gives instead of the detected ones."""
    m = this_machine()
    if t.gpu_memory is not None:
        m = Machine(m.host_ram, True, "target GPU (machine.gpu_memory)", parse_size(t.gpu_memory, "machine.gpu_memory"))
    if t.host_memory is not None:
        m = Machine(parse_size(t.host_memory, "machine.host_memory"), m.cuda, m.gpu_name, m.gpu_mem)
    return m
