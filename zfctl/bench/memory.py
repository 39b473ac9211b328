"""Will a configuration fit (rough byte counts decided before anything is allocated), and how
much did it take (peaks measured while it ran).

The numbers follow the state layout of docs/design.md, section "Defaults and the numbers behind
them": every offloaded element costs the host an fp32 master, two fp32 moments and an fp32
gradient accumulator (16 B); every element updated on the device costs the device the same
master and moments plus an fp32 gradient buffer (16 B). `off` puts all of them on the device.
"""

from __future__ import annotations

import torch

from zfctl.errors import UserError
from zfctl.offload.cpu.host import available_ram
from zfctl.train.metrics import peak_rss_bytes

GiB = 1024**3
HOST_BYTES_PER_OFFLOADED_PARAM = 16  # fp32 master + exp_avg + exp_avg_sq + accumulator
DEVICE_BYTES_PER_DEVICE_PARAM = 16  # fp32 master + exp_avg + exp_avg_sq + gradient buffer (plan/memory.py)
MARGIN = 0.10  # keep 10% free for activations, allocator slack, pinned rings


def host_available_bytes() -> float | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping): the engine's
    reader (zfctl/offload/cpu/host.py ``available_ram``); None when the system does not say."""
    return available_ram()


def device_available_bytes(device: torch.device) -> float | None:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return float(free)
    return host_available_bytes()


def off_fits(n_params: int, grad_bytes: int, device: torch.device) -> tuple[bool, str]:
    """Can `off` (plain device AdamW) hold fp32 master + moments and the grads on `device`?

    Called with the model already built, so its weights are not counted again.
    """
    need = n_params * DEVICE_BYTES_PER_DEVICE_PARAM + grad_bytes
    have = device_available_bytes(device)
    if have is None:  # nothing says what is free: let the run find out
        return True, f"needs ~{need / GiB:.1f} GiB on {device.type}, free memory unknown"
    ok = need <= have * (1 - MARGIN)
    return ok, f"needs ~{need / GiB:.1f} GiB on {device.type}, {have / GiB:.1f} GiB free"


def check_host_fits(n_params: int) -> None:
    """Refuse up front when the offloaded optimizer state cannot fit in host RAM."""
    need = n_params * HOST_BYTES_PER_OFFLOADED_PARAM
    have = host_available_bytes()
    if have is not None and need > have * (1 - MARGIN):
        raise UserError(
            f"the benchmark model has {n_params / 1e6:.0f}M params: the offloaded optimizer state "
            f"needs ~{need / GiB:.1f} GiB of host RAM, {have / GiB:.1f} GiB is available; "
            "use a smaller --hidden-dim/--nlayers or --model"
        )


def reset_peaks(device: torch.device) -> bool:
    """Open a configuration's peak window: the CUDA allocator's peaks and the process's VmHWM.

    Writing 5 to /proc/self/clear_refs (Linux >= 4.0) sets VmHWM back to the current RSS. Returns
    False where that is refused (no /proc, a sandbox): the host peak then covers the process so far.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def read_peaks(device: torch.device) -> dict[str, int | None]:
    """Peak host RSS (VmHWM) and peak CUDA memory since `reset_peaks`; None where not measurable.

    The host peak includes everything the process holds: for `--model`, the host copy of the
    weights every trial starts from, and pinned blocks the caching host allocator kept.
    """
    out: dict[str, int | None] = {
        "peak_host_rss_bytes": peak_rss_bytes(),
        "peak_device_allocated_bytes": None,
        "peak_device_reserved_bytes": None,
    }
    if device.type == "cuda":
        out["peak_device_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["peak_device_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    return out
