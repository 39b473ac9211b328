"""The machine a plan is checked against: this one, or the sizes the plan's `machine` section names.

`--gpu-memory 80GB` / `--host-memory 128GB` (`machine.gpu_memory`, `machine.host_memory`) let a
laptop plan the GPU run; without them :func:`this_machine` says what this process can use: the
host RAM under the process's memory cap (cgroup ``memory.max`` / ``memory.limit_in_bytes``,
``RLIMIT_AS`` / ``RLIMIT_DATA``, where readable: :func:`process_memory_cap`), and the GPU this
process trains on (``LOCAL_RANK``'s under torchrun, else the current device: a rank on GPU 3
plans for GPU 3, a MIG slice for the slice), its memory under torch's per-process fraction
(``torch.cuda.set_per_process_memory_fraction``, how scripts/zf_memstats.py emulates a smaller
card). Capacities, not free memory: every rank of a job resolves the plan's ``auto`` values
(zfctl/plan/settle.py) against the same numbers, and what is free now is the run's check
(zfctl/plan/holds.py). Sizes are decimal GB (1e9 bytes), as GPU vendors and the ZenFlow paper
quote them; the binary units are accepted too.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

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
    """Host RAM (under the process's cap) and the CUDA device this process trains on, if any."""
    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 0.0
    cap = process_memory_cap()
    if cap is not None and (not ram or cap < ram):
        ram = cap
    if no_cuda_reason() is not None:  # no GPU driver: torch (~2 s to import) could only say "no CUDA"
        return Machine(ram, False)
    import torch

    try:
        if torch.cuda.is_available():
            index = local_cuda_index()
            prop = torch.cuda.get_device_properties(index)
            total, name = float(prop.total_memory), f"{prop.name} (cuda:{index})"
            fraction = memory_fraction(index)
            if fraction < 1.0:  # torch refuses allocations past it: the card this process has is smaller
                total, name = fraction * total, f"{name}, capped to {fraction:.3g} of it"
            return Machine(ram, True, name, total)
    except RuntimeError as e:  # a broken CUDA driver must not break `zfctl plan`
        return Machine(ram, False, gpu_name=f"CUDA error: {e}")
    return Machine(ram, False)


def local_cuda_index() -> int:
    """The CUDA device this process trains on: its rank's ``LOCAL_RANK`` under torchrun (as
    zfctl/train/dist.py ``train_device`` picks it), else the current device (0 unless set)."""
    import torch

    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit() and int(local) < torch.cuda.device_count():
        return int(local)
    return torch.cuda.current_device()


def memory_fraction(index: int) -> float:
    """torch's per-process memory fraction of device ``index`` (1.0 when unset or unknown)."""
    import torch

    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    try:
        return float(get(index)) if get is not None else 1.0
    except (RuntimeError, TypeError, ValueError):
        return 1.0


_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as 2^63 rounded down to a page; v2 as "max"


def process_memory_cap(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """Bytes this process may hold at most, where something caps it (None: no cap found).

    The smallest of: the memory limit of this process's cgroup and every cgroup above it (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``; in a cgroup namespace the mount's root is this
    process's own cgroup, read too), and the soft ``RLIMIT_AS`` / ``RLIMIT_DATA``. A container's
    ``/proc/meminfo`` shows the host's RAM, not the container's limit: this is what says it.
    """
    caps: list[float] = []
    for path in _cgroup_limit_files(Path(root), Path(proc_cgroup)):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _UNLIMITED:
            caps.append(float(text))
    import resource

    for which in ("RLIMIT_AS", "RLIMIT_DATA"):
        try:
            soft = resource.getrlimit(getattr(resource, which))[0]
        except (AttributeError, OSError, ValueError):
            continue
        if soft != resource.RLIM_INFINITY and soft > 0:
            caps.append(float(soft))
    return min(caps) if caps else None


def _cgroup_limit_files(root: Path, proc_cgroup: Path) -> list[Path]:
    """The cgroup memory-limit files that apply to this process: each of its cgroups' (from
    ``proc_cgroup``) and their parents' under ``root``, v2 and v1."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    out: list[Path] = [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if not hierarchy or not rel.startswith("/"):
            continue
        base, name = ((root, "memory.max") if controllers == "" else
                      (root / "memory", "memory.limit_in_bytes") if "memory" in controllers.split(",") else
                      (None, ""))
        if base is None:
            continue
        here = base / rel.lstrip("/")
        while True:  # this cgroup and every one above it: the smallest limit binds
            out.append(here / name)
            if here == base:
                break
            here = here.parent
    return list(dict.fromkeys(out))


def target_machine(t: MachineConfig) -> Machine:
    """This machine, with the sizes the plan's ``machine`` section gives instead of the detected ones."""
    m = this_machine()
    if t.gpu_memory is not None:
        m = Machine(m.host_ram, True, "target GPU (machine.gpu_memory)", parse_size(t.gpu_memory, "machine.gpu_memory"))
    if t.host_memory is not None:
        m = Machine(parse_size(t.host_memory, "machine.host_memory"), m.cuda, m.gpu_name, m.gpu_mem)
    return m
