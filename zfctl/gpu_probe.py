"""Whether this process could see a CUDA device at all, answered without importing torch.

`import torch` costs about 2 s of a 2-core machine, and the light verbs (`zfctl plan`, `zfctl
doctor`, `train.precision: auto`) used to pay it only to hear `torch.cuda.is_available() ==
False`. A GPU torch can use always shows up as a device node of its kernel driver: NVIDIA's
(`/dev/nvidiactl`, `/dev/nvidia0`, `/proc/driver/nvidia`, what the container runtime mounts too),
Jetson's integrated GPU (`/dev/nvhost-ctrl-gpu`, `/dev/nvmap`), AMD's ROCm builds of torch, which
answer through `torch.cuda` (`/dev/kfd`), and WSL2's GPU paravirtualisation (`/dev/dxg`).
Without any of them, or with `CUDA_VISIBLE_DEVICES` set empty, torch cannot find a device, so the
caller skips torch. Where one exists, only torch can say whether it works: the callers import it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Files whose presence means a GPU driver torch may use is loaded (paths under the root).
DRIVER_NODES = (
    "dev/nvidiactl",
    "dev/nvidia0",
    "proc/driver/nvidia",
    "dev/nvhost-ctrl-gpu",
    "dev/nvmap",
    "dev/kfd",
    "dev/dxg",
)


def no_cuda_reason(root: Path = Path("/")) -> str | None:
    """Why torch cannot see a CUDA device in this process, or None when it may (then ask torch).

    ``root`` is for tests; it stands for the file system root.
    """
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "CUDA_VISIBLE_DEVICES is empty"
    if sys.platform == "darwin":
        return "macOS has no CUDA"
    if not sys.platform.startswith("linux"):
        return None  # no device-node convention to rely on: let torch answer
    if any((root / node).exists() for node in DRIVER_NODES):
        return None
    return "no GPU driver loaded (no /dev/nvidia*, /dev/kfd or /dev/dxg)"
