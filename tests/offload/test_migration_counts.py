"""A selection at the 1.24B Llama's real shapes (llama3.2-1b: 113 selectable matrices in three
device blocks, 45,513 device columns) issues a bounded number of device operations, gathers no
host row on the training thread, and cuts the priority request's runs once: the counts of
zfctl/bench/selection.py, never its times. Per-matrix device work would cost at least one
operation per matrix and state tensor (over 400); the planner and the migration work per device
block (zfctl/offload/columns/migration.py)."""

from __future__ import annotations

import pytest

from zfctl.bench.selection import run_selection
from zfctl.cli._bench_flags import _model_config


@pytest.mark.parametrize("stay", [0.1, 0.9])
def test_a_selection_at_the_1b_shapes_is_counted_per_block(stay) -> None:
    r = run_selection(_model_config("llama3.2-1b"), stay, repeats=1)
    assert r["matrices"] == 113 and r["device_blocks"] == 3
    assert 0 < r["device_ops"] <= 100, r["device_ops"]
    assert r["main_thread_gathers"] == 0 and r["fill_gathers"] > 0  # the worker's fill gathers them
    assert r["priority_cuts"] == 1
