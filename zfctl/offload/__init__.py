"""The ZenFlow optimizer core: a library that knows nothing of the CLI, presets or datasets.

    opt = ZenFlowOptimizer(model.named_parameters(), ZenFlowConfig(topk_ratio=0.1), lr=1e-4)
    loss = opt.scale_loss(loss); loss.backward(); stats = opt.step(); opt.zero_grad()

With ``ZenFlowConfig(vocab_select="rows")``, pass ``vocab_params=vocab_matrices(model)``: the
embedding and output head then choose tokens (rows) instead of hidden dimensions.

The names below load on first use (PEP 562): importing a torch-free submodule such as
``zfctl.offload.config`` (the ``zenflow`` section of every plan) or ``zfctl.offload.sizing``
(the size rules the plan shares) must not pay for torch, about 2 s of a 2-core machine, or
``zfctl presets ls`` and ``zfctl plan`` would (tests/cli/test_light_verbs.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zfctl.offload.config import ZenFlowConfig
    from zfctl.offload.layout import vocab_matrices
    from zfctl.offload.optimizer import ZenFlowOptimizer
    from zfctl.offload.stats import StepStats

__all__ = ["StepStats", "ZenFlowConfig", "ZenFlowOptimizer", "vocab_matrices"]

# public name -> the submodule that defines it
_WHERE = {
    "StepStats": "zfctl.offload.stats",
    "ZenFlowConfig": "zfctl.offload.config",
    "ZenFlowOptimizer": "zfctl.offload.optimizer",
    "vocab_matrices": "zfctl.offload.layout",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:  # AttributeError lets `from zfctl.offload import pinned` import the submodule
        raise AttributeError(f"module 'zfctl.offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
