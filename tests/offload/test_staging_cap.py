"""The out buffer of a selection's migration is capped by ``zenflow.tuning.staging_mb`` (the plan
sizes it to what the host has to spare, zfctl/plan/layouts.py): the leaving rows beyond the cap
wait for the buffer to drain (migration.py ``_make_room``), a counted ``host.migrate_out`` wait,
and change no result.

TinyNet's matrices are 48 rows tall; with sizing.STAGE_BYTES shrunk to one such row (so the cap's
floor, one packed piece, is one row) a 1-row cap drains after every leaving row, while the
default cap (2 GiB) holds every selection whole.
"""

from __future__ import annotations

import torch
from test_offload_helpers import batches, snapshot, tiny_net, zen

from zfctl.offload import ZenFlowOptimizer, sizing

HP = {"lr": 1e-2, "weight_decay": 0.01}
SELECT, STEPS = 4, 13  # selections at 0, 4, 8, 12


def _run(staging_mb: float | str) -> tuple[dict[str, torch.Tensor], int, int]:
    """(the params after STEPS steps, the drains counted, the out buffer's bytes)."""
    model = tiny_net()
    cfg = zen(topk_ratio=0.25, update_interval=2, select_interval=SELECT, overlap_step=True, full_warm_up_rounds=0,
              accumulate="host", staging_mb=staging_mb)
    drains = 0
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        for x, y in batches(STEPS):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            drains += opt.step().waits.get("host.migrate_out", 0)
        opt.flush()
        out = opt.selector.mover._out  # made at the first selection
        out_bytes = out.numel() * out.element_size()
    return snapshot(model), drains, out_bytes


def test_a_small_out_buffer_drains_with_counted_waits_and_the_same_bits(monkeypatch) -> None:
    row = 48 * 4  # one leaving column's fp32 row of a 48-row matrix
    monkeypatch.setattr(sizing, "STAGE_BYTES", row)
    ref, ref_drains, ref_out = _run("auto")  # no plan: the 2 GiB cap, here every leaving row
    got, drains, out = _run(row / 2**20)
    assert ref_drains == 0 and out == row < ref_out
    assert drains > 0  # every selection after the first leaves more than one row
    assert all(torch.equal(ref[n], got[n]) for n in ref)
