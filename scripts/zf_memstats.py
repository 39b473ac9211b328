"""Run `zfctl ARGS` in this process and, when it exits, write to STATS.json what only the process
itself can see (used by scripts/gpu_7b.py):

    python3 scripts/zf_memstats.py STATS.json [--cap-gpu-memory BYTES] finetune MODEL --data DATA ...

- pinned host memory: torch's caching host allocator's peak (`pin_memory=True` tensors; it
  rounds each block up to a power of two, so this is what was pinned, not what was asked for),
  and the peak of `zfctl.offload.device.pinned.registered_bytes()` (buffers zfctl pins itself), sampled
  every 0.25 s once the run has imported that module; null where this build has no such module;
- peak CUDA memory, allocated and reserved (the run's metrics.jsonl has allocated only);
- VmHWM, the process's own peak RSS.

``--cap-gpu-memory BYTES`` makes a larger GPU behave like a smaller one before zfctl starts:
``torch.cuda.set_per_process_memory_fraction(BYTES / total)`` on device 0, so the caching allocator
raises out-of-memory where a card of BYTES would (the CUDA context, outside the allocator, is not
counted: a real card of that size has a little less). The cap is in the stats file too.

Nothing is written when the process is killed (SIGKILL, the OOM killer): the caller measures the
peak RSS from outside as well.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path

_registered = {"peak": None}
_cap: dict = {"gpu_memory_cap_bytes": None, "gpu_memory_fraction": None, "gpu_total_bytes": None}


def _registered_now() -> int | None:
    # Read only what the run imported itself: importing zfctl.offload from this thread while the
    # main thread imports the CLI would race for the import locks and change what the run loads.
    fn = getattr(sys.modules.get("zfctl.offload.device.pinned"), "registered_bytes", None)
    return int(fn()) if fn is not None else None


def _sample() -> None:
    while True:
        try:
            now = _registered_now()
        except Exception:  # noqa: BLE001 (a half-initialised module mid-import: try again next time)
            now = None
        if now is not None:
            _registered["peak"] = max(now, _registered["peak"] or 0)
        time.sleep(0.25)


def _vm_hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cap_fraction(cap: int, total: int) -> float:
    """The share of a ``total``-byte GPU that leaves ``cap`` bytes to the caching allocator."""
    if not 0 < cap <= total:
        raise SystemExit(f"zf_memstats: --cap-gpu-memory {cap}: must be > 0 and at most the GPU's {total} bytes")
    return cap / total


def _cap_gpu(cap: int) -> None:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    fraction = cap_fraction(cap, total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    _cap.update(gpu_memory_cap_bytes=cap, gpu_memory_fraction=fraction, gpu_total_bytes=total)


def _dump(stats_file: Path) -> None:
    out: dict = {"vm_hwm_bytes": _vm_hwm(), "registered_peak_bytes": _registered["peak"],
                 "registered_available": "zfctl.offload.device.pinned" in sys.modules,
                 "caching_allocator_peak_bytes": None, "device_allocated_peak_bytes": None,
                 "device_reserved_peak_bytes": None, **_cap}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        stats = getattr(torch.cuda, "host_memory_stats", dict)()  # absent before torch 2.7
        out["caching_allocator_peak_bytes"] = stats.get("allocated_bytes.peak")
        out["device_allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
        out["device_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
    tmp = stats_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp, stats_file)


if __name__ == "__main__":
    # Read here, not at import: tests import this file for cap_fraction under any sys.argv.
    atexit.register(_dump, Path(sys.argv[1]))  # runs on a normal exit and on SystemExit (every zfctl error)
    threading.Thread(target=_sample, daemon=True).start()
    rest = sys.argv[2:]
    if rest[:1] == ["--cap-gpu-memory"]:
        _cap_gpu(int(rest[1]))
        rest = rest[2:]
    sys.argv = ["zfctl", *rest]
    from zfctl.cli import main

    main()
