"""The ZenFlow optimizer core: a library that knows nothing of the CLI, presets or datasets."""

from zfctl.offload.config import ZenFlowConfig

__all__ = ["ZenFlowConfig"]
