"""Build the optimizer a plan asks for: the ZenFlow optimizer over the model's trainable weights."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from zfctl.plan.schema import RunPlan


def build_optimizer(model: torch.nn.Module, plan: RunPlan, *, steps_per_epoch: int,
                    process_group: Any = None) -> Any:
    """A ``ZenFlowOptimizer`` configured from ``plan.train`` and ``plan.zenflow``.

    Every zenflow preset goes through the same optimizer: ``zero-offload`` is ``topk_ratio 0,
    update_interval 1, overlap off`` (plain CPU offload) and ``off`` keeps everything on the
    device (``topk_ratio 1``), so one code path serves all of them and the loop never branches.
    Parameters are passed with their names (they appear in errors and in the state_dict);
    ``named_parameters`` yields a tied weight once. Frozen parameters are left out.
    """
    from zfctl.offload import ZenFlowOptimizer

    t = plan.train
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    zen = plan.zenflow
    if zen.accumulate == "auto" and params and params[0][1].device.type == "cuda":
        from zfctl.plan.memory import estimate

        # The plan's memory estimate decides (the same choice `zfctl plan` shows).
        zen = replace(zen, accumulate=estimate(plan).accumulate)
    return ZenFlowOptimizer(
        params, zen, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, loss_scaling=None, steps_per_epoch=steps_per_epoch,
        process_group=process_group,
    )
