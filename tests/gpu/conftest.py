"""GPU tests reuse the CPU tests' tiny model and loop (tests/test_offload_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
