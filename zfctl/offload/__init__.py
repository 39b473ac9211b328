"""The ZenFlow optimizer core: a library that knows nothing of the CLI, presets or datasets.

    opt = ZenFlowOptimizer(model.named_parameters(), ZenFlowConfig(topk_ratio=0.1), lr=1e-4)
    loss = opt.scale_loss(loss); loss.backward(); stats = opt.step(); opt.zero_grad()

With ``ZenFlowConfig(vocab_select="rows")``, pass ``vocab_params=vocab_matrices(model)``: the
embedding and output head then choose tokens (rows) instead of hidden dimensions.
"""

from zfctl.offload.config import ZenFlowConfig
from zfctl.offload.layout import vocab_matrices
from zfctl.offload.optimizer import ZenFlowOptimizer
from zfctl.offload.stats import StepStats

__all__ = ["StepStats", "ZenFlowConfig", "ZenFlowOptimizer", "vocab_matrices"]
