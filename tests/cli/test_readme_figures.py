"""The README's and docs/' quotes of program output are the program's output (scripts/readme_figures.py).

A figure typed by hand drifts when the program changes (a no-fit example, a memory
row, a 7B plan without its newest line and a step count that no longer matched). Each quote is
regenerated here from the program and compared; `make readme-figures` rewrites them after a
change that moves a figure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import readme_figures as figures

FIX = "the README/docs quotes drifted from the program: run `make readme-figures` and check the diff"


@pytest.mark.parametrize("name", ["plan-7b", "plan-no-fit", "memory-7b", "presets-models"])
def test_plan_quotes_are_what_zfctl_plan_prints(name: str) -> None:
    """`zfctl plan` and the memory estimate load no torch: these run in seconds, in `make test-fast` too."""
    assert figures.quoted(name) == figures.BLOCKS[name](), FIX


@pytest.mark.slow
def test_demo_quotes_and_step_counts_are_the_programs() -> None:
    """The demo's `next:` block and closing lines, its step count (README and the tiny-llama
    preset's comment), the memory figures in prose and in the presets' comments: the whole check,
    as the script runs it."""
    assert figures.drift(figures.regenerate()) == "", FIX


def test_every_block_has_a_generator_and_one_place() -> None:
    where = figures.block_names()
    assert sorted(where) == sorted(figures.BLOCKS)
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
