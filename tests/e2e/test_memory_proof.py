"""A whole CPU run takes the memory the plan says, checkpoint save and resume included, under
both host gradient layouts (``zenflow.tuning.grad_layout``: slots and carry).

scripts/memory_proof.py at a smaller size (48.8M against 13.4M parameters, fp32): the peak RSS of
`zfctl finetune` (training, then a checkpoint at step 6, inside an interval) and of `zfctl resume`
(loading it mid-interval, training, a checkpoint) differ between the two sizes by the plan's
difference within 10% (measured: slots +0.1% and +1.0%, carry +2.0% and +0.7%). A save that
copied the optimizer state, or a resume that read it into fresh buffers, adds 16-36 B per
parameter at that moment: 30-90% here; a save that formed the interval's sum whole, or a carry
resume that loaded it beside the carry, adds 4 B per parameter (7-14%). And each run's own peak
is the plan's total, its process baseline line included, within 5% (measured: +0.0% to +1.1%): a
line of 4 B per parameter that the plan forgot (0.2 GB at 48.8M), or no baseline (0.45 GB), is
outside it. Under slots a resume inside an interval also holds that interval's fp32 sum until its
boundary (a note of the plan, not a line): its peak may lie up to that much above the total.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _measure(proof, tmp_path: Path, layout: str) -> tuple[dict, dict, dict]:
    extra = [f"zenflow.tuning.grad_layout={layout}"]
    big = proof.measure(6, 768, 2048, tmp_path, extra)
    small = proof.measure(1, 768, 2048, tmp_path, extra)
    return big, small, proof.compare(big, small)


def _line(big: dict, small: dict, c: dict, process: str) -> str:
    r = c[process]
    return (f"{process}: peak RSS {big[f'peak_rss_{process}']} vs {small[f'peak_rss_{process}']} B, difference "
            f"{r['measured_difference']} B against the plan's {c['plan_difference']:.0f} B")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["slots", "carry"])
def test_peak_rss_difference_matches_the_plan(tmp_path: Path, layout: str) -> None:
    """Each process's own VmHWM (scripts/memory_proof.py ``peak_rss``): ``ru_maxrss`` would read
    the pytest process's RSS as the floor of every subprocess, which late in a full suite is more
    than the small run's own peak."""
    spec = importlib.util.spec_from_file_location("memory_proof", ROOT / "scripts" / "memory_proof.py")
    assert spec is not None and spec.loader is not None
    proof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proof)
    big, small, c = _measure(proof, tmp_path, layout)
    assert big["plan_items"].get("gradient carry" if layout == "carry" else "gradient slots")  # the layout asked for
    assert c["plan_difference"] > 0.5e9  # large enough that the baseline's noise (~10 MB) is small
    for process in ("finetune", "resume"):
        assert c[process]["within_tolerance"], _line(big, small, c, process)
        for size, a in c[process]["absolute"].items():
            assert a["within_tolerance"], (f"{process} ({size}): peak RSS {a['peak_rss']} B against the plan's "
                                           f"{a['plan_bytes']:.0f} B")
    assert c["ok"]
