"""The RNG state of one rank, saved as ``rng-rankRRRRR.pt`` and restored last on resume."""

from __future__ import annotations

import random
from typing import Any

import torch


def seed_rngs(seed: int) -> None:
    """Every RNG :func:`capture_rng` saves, from one seed (a run's ``train.seed``: dist.py
    ``process_setup``), so that two runs of one plan draw alike and write the same RNG file.
    numpy is optional for zfctl."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def capture_rng() -> dict[str, Any]:
    """Every RNG a training step may draw from (dropout, data augmentation, user code)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        # Stored as plain tensors and numbers, not numpy objects, so that the file loads with
        # torch.load(weights_only=True) like every other checkpoint file.
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    except ImportError:  # numpy is optional for zfctl itself
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` saved (CUDA only where this process has CUDA)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
