"""Three ranks issue the same collectives in the same order, whatever their gradient hooks did.

The hook path starts each matrix's exchange inside its gradient hook (zfctl/offload/grads/stream.py).
Here one matrix (``side``) gets no gradient on rank 1 in any step, and on rank 2 none in the last
micro-batch of a step (its ``.grad`` comes from an earlier micro-batch, so its hook does not fire
in the final backward). If the ranks issued collectives in hook order, rank 1 would start the
next matrix's exchange while ranks 0 and 2 start ``side``'s: mismatched messages, a hang or an
error. In one fixed order every rank matches; the run must finish within the timeout, equal one
process trained on all three ranks' micro-batches within 1e-6, and equal the step() path of the
same three ranks bit for bit (per-matrix messages in both paths: the same summation order on 3
ranks, zfctl/offload/parallel/exchange.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from proc_helpers import rendezvous, spawn_ranks
from test_offload_helpers import zen
from torch import nn

from zfctl.offload import ZenFlowOptimizer

WORLD, STEPS, PER_RANK, MICRO = 3, 10, 4, 2
CFG = {"topk_ratio": 0.25, "update_interval": 3, "overlap_step": True, "select_interval": 6,
       "full_warm_up_rounds": 1, "cpu_threads": 1, "pin_memory": False}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.side = nn.Linear(32, 32, bias=False)
        self.fc2 = nn.Linear(32, 24)
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if use_side:
            h = h + torch.tanh(self.side(h))
        return self.head(torch.tanh(self.fc2(h)))


def uses_side(rank: int, micro: int) -> bool:
    """Rank 1 never uses ``side``; rank 2 only in its first micro-batch."""
    return rank == 0 or (rank == 2 and micro == 0)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, WORLD * PER_RANK, 16, generator=g), torch.randn(STEPS, WORLD * PER_RANK, 8, generator=g)


def _train(ranks: list[int], world: int, *, hooks: bool, group=None, device: str = "cpu",
           extra: dict | None = None, no_syncs: bool = False) -> dict:
    """Train on the micro-batches of ``ranks`` (this process's own rank, or all of them alone);
    tests/gpu/test_nccl.py runs the same on CUDA, with ``extra`` config (its gradient paths) and,
    with ``no_syncs``, every implicit host-device sync an error outside warm-up and selection
    steps (tests/gpu/test_sync_points.py)."""
    torch.manual_seed(0)
    model = Net().to(device)
    x, y = (t.to(device) for t in _data())  # once: a blocking copy per micro-batch would be a sync
    n = len(ranks) * MICRO
    # release_grads off: the hooks' collectives without release (2 ranks with release:
    # tests/offload/test_offload_stream_dist.py)
    with ZenFlowOptimizer(model.named_parameters(), zen(**{**CFG, "release_grads": False, **(extra or {})}),
                          lr=5e-3, weight_decay=0.01,
                          max_grad_norm=0.5, process_group=group) as opt:
        for t in range(STEPS):
            steady = no_syncs and t >= opt.selector.warmup and not opt.selector.due(t)
            if steady:
                torch.cuda.set_sync_debug_mode("error")
            micro = [(r, m) for r in ranks for m in range(MICRO)]
            for i, (r, m) in enumerate(micro):
                lo = r * PER_RANK + m * (PER_RANK // MICRO)
                xs, ys = x[t, lo : lo + PER_RANK // MICRO], y[t, lo : lo + PER_RANK // MICRO]
                if hooks:
                    opt.prepare_backward(final=i == len(micro) - 1)
                (F.mse_loss(model(xs, uses_side(r, m)), ys) / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if steady:
                torch.cuda.set_sync_debug_mode(0)
        opt.flush()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        res = {"hooks": _train([rank], WORLD, hooks=True, group=dist.group.WORLD),
               "step": _train([rank], WORLD, hooks=False, group=dist.group.WORLD)}
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_three_ranks_with_an_ungraded_parameter_finish_and_match_one_rank(tmp_path: Path) -> None:
    spawn_ranks(_worker, WORLD, (rendezvous(tmp_path), str(tmp_path)), timeout=240,
                what="the three ranks (their collectives did not match)")
    ref = _train(list(range(WORLD)), 1, hooks=False)
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        hooks, step = res["hooks"], res["step"]
        assert all(torch.equal(hooks[k], step[k]) for k in ref), rank  # both paths: the same sums
        for k in ref:  # relative error as the other data-parallel tests measure it (tests/offload/test_distributed.py)
            err = float((hooks[k] - ref[k]).norm() / ref[k].norm())
            assert err <= 1e-6, (rank, k, err)
    assert not torch.equal(ref["side.weight"], Net().side.weight)  # side trained (ranks 0 and 2)
