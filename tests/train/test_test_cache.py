"""The test suite keeps its own cache folder (tests/conftest.py), never the user's ~/.cache/zfctl."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from zfctl.train.data.cache import cache_root

ROOT = Path(__file__).resolve().parents[2]


def test_tests_cache_outside_the_users_cache() -> None:
    user = Path.home() / ".cache"
    here = cache_root().resolve()
    assert not here.is_relative_to(user.resolve()), f"tests cache into {here}"
    # a process the tests start (every CLI subprocess test) inherits the same folder
    out = subprocess.run([sys.executable, "-c", "from zfctl.train.data.cache import cache_root; print(cache_root())"],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert Path(out.stdout.strip()).resolve() == here
    hf = Path(os.environ["HF_DATASETS_CACHE"]).resolve()
    assert not hf.is_relative_to(user.resolve())
