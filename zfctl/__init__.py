"""zfctl: fine-tune LLMs with stall-free CPU optimizer offload (ZenFlow, arXiv 2505.12242)."""

__version__ = "0.1.0"
