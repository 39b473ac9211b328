"""The library example of docs/library.md (the README points there) is scripts/library_example.py, and it runs: the loss falls and
ZenFlow engages after its warm-up (the selected share is 0 during it, topk_ratio after)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "library_example.py"


def _readme_snippet() -> list[str]:
    text = (ROOT / "docs" / "library.md").read_text(encoding="utf-8")
    section = text[text.index("# Using ZenFlow in your own training loop"):]
    block = section[section.index("```python\n") + len("```python\n"):]
    return block[:block.index("```")].splitlines()


def test_the_readme_shows_the_script() -> None:
    """Every line of docs/library.md's snippet is a line of the script (indentation aside), so the
    snippet cannot drift from code that runs."""
    script = {line.strip() for line in SCRIPT.read_text(encoding="utf-8").splitlines()}
    missing = [line for line in _readme_snippet() if line.strip() and line.strip() not in script]
    assert not missing, missing
    for doc in ("README.md", "docs/library.md"):
        assert "python scripts/library_example.py" in (ROOT / doc).read_text(encoding="utf-8"), doc


@pytest.mark.slow
def test_the_example_runs_and_zenflow_engages() -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), "--steps", "24", "--warm-up", "4"], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Warning" not in res.stderr, res.stderr  # a runnable example prints no torch UserWarning
    rows = [tuple(map(float, m.groups())) for m in
            re.finditer(r"step +(\d+) +loss ([\d.]+) +sel ([\d.]+)", res.stdout)]
    assert [int(r[0]) for r in rows] == list(range(1, 25))
    sel = [r[2] for r in rows]
    assert sel[:4] == [0.0] * 4 and min(sel[4:]) > 0  # plain AdamW during the warm-up, ZenFlow after
    losses = [r[1] for r in rows]
    assert sum(losses[-4:]) / 4 < losses[0] - 0.5  # it learns (from ~5.6, ln 256 = 5.5)
