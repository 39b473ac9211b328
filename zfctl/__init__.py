"""zfctl: fine-tune LLMs with stall-free CPU optimizer offload (ZenFlow, arXiv 2505.12242)."""

import os

# Torch's OpenMP threads busy-wait after every CPU op by default. While zfctl's CPU AdamW runs in
# the background, that spinning takes the cores it needs: measured on a 2-core machine, the tiny
# demo ran 40 steps in 19.1 s with ACTIVE waiting and 15.7 s with PASSIVE (the native kernel
# engineer saw 0.3-6.8 s vs 0.13-0.26 s per CPU step under load). libgomp reads this once, when
# torch loads it, so it only takes effect when zfctl is imported before torch (the CLI always
# is). A value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
