"""The ZenFlow optimizer core: a library that knows nothing of the CLI, presets or datasets.

    opt = ZenFlowOptimizer(model.named_parameters(), ZenFlowConfig(topk_ratio=0.1), lr=1e-4)
    loss = opt.scale_loss(loss); loss.backward(); stats = opt.step(); opt.zero_grad()
"""

from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.optimizer import ZenFlowOptimizer
from zfctl.offload.stats import StepStats

__all__ = ["StepStats", "ZenFlowConfig", "ZenFlowOptimizer"]
