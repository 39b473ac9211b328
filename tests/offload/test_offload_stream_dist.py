"""The hook path with data parallelism: 2 ranks on gloo, gradient accumulation over 1 or 2 micro-batches.

Each rank trains the same run twice, once moving gradients in step() and once during the last
backward (the hooks exchange each matrix over the ranks before copying it,
zfctl/offload/parallel/exchange.py); both must give the same parameters bit for bit and send the same
bytes, and the hook run must really have streamed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from proc_helpers import rendezvous, spawn_ranks
from test_offload_helpers import zen

from zfctl.offload import ZenFlowOptimizer

STEPS, BATCH, MICRO = 12, 8, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 8))


def _train(rank: int, world: int, hooks: bool, release: bool = True,
           clip: float | None = 0.5) -> tuple[dict, list[int], list[int], list[int]]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS, BATCH, 16, generator=g), torch.randn(STEPS, BATCH, 8, generator=g)
    cfg = zen(topk_ratio=0.25, update_interval=3, overlap_step=True, cpu_threads=1, pin_memory=False,
              release_grads=release)
    model, per = _model(), BATCH // world
    early, sent, held = [], [], []
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=2e-2, weight_decay=0.01, max_grad_norm=clip,
                          process_group=dist.group.WORLD) as opt:
        for t in range(STEPS):
            xs, ys = x[t, rank * per : (rank + 1) * per], y[t, rank * per : (rank + 1) * per]
            # Every third step one micro-batch: the hooks then run while later params have no
            # .grad yet (set_to_none), as in a run without accumulation.
            micro = 1 if t % 3 == 0 else MICRO
            for i, (xm, ym) in enumerate(zip(xs.chunk(micro), ys.chunk(micro))):
                if hooks:
                    opt.prepare_backward(final=i == micro - 1)
                (F.mse_loss(model(xm), ym) / micro).backward()
            before = sum(p.grad is not None for p in model.parameters() if p.dim() == 2)
            st = opt.step()
            # step() must not give a released matrix its .grad back (as zeros, exchange.py reduce)
            held.append((before, sum(p.grad is not None for p in model.parameters() if p.dim() == 2)))
            early.append(st.early_chunks)
            sent.append(st.comm_bytes)
            opt.zero_grad(set_to_none=True)
        opt.flush()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, early, sent, held


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        # with the clip, the hook path (here without release_grads) equals the step() path
        res = {"step": _train(rank, world, hooks=False), "hooks": _train(rank, world, hooks=True, release=False),
               # release_grads on and off, without clipping: the same arithmetic (release.py)
               "on": _train(rank, world, hooks=True, clip=None),
               "off": _train(rank, world, hooks=True, release=False, clip=None)}
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_hook_path_equals_step_path(tmp_path) -> None:
    spawn_ranks(_worker, 2, (2, rendezvous(tmp_path), str(tmp_path)), timeout=240, what="the two ranks")
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        (ref, ref_early, ref_sent, _), (got, early, sent, _) = res["step"], res["hooks"]
        assert all(torch.equal(ref[k], got[k]) for k in ref), rank
        assert sent == ref_sent and min(sent) > 0, (ref_sent, sent)
        assert sum(ref_early) == 0 and sum(e > 0 for e in early) >= STEPS - 3  # selections: step() path
        (on, _, on_sent, held_on), (off, _, off_sent, held_off) = res["on"], res["off"]
        assert all(torch.equal(on[k], off[k]) for k in on), rank
        assert on_sent == off_sent
        # the matrices' .grad left in their hooks, except at the selection (step 0: the ranks'
        # scores are all-reduced from .grad in step()) and the last one exchanged, whose exchange
        # step() completes and then releases (each completes one hook later, overlapping the next
        # backward); after step() none is back
        assert held_on == [(3, 3)] + [(1, 0)] * (STEPS - 1) and held_off == [(3, 3)] * STEPS, held_on
