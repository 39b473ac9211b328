"""The ``carry`` gradient layout on two ranks (gloo, CPU): the same bits as ``slots``.

zero2: each rank owns half of the host columns and folds only its own (the hooks land each
gradient after its exchange, stream.py): its weights, its checkpoint inside an interval (the
interval sum of its columns) and a resume from that checkpoint must be the slots layout's, bit
for bit. fsdp: each rank folds the host columns of its FSDP2 shards (FSDP2's hooks land them,
sharded.py): a narrowed tiny Llama's losses and local shards, bit for bit, and a carry run
resumed from its state_dicts inside an interval the same. Each with clipping
off and with a clip norm of 0.05, which changes the run (asserted; the interval-mean rule: the
same factor at the boundary on both layouts). One spawn runs every case.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from proc_helpers import rendezvous, spawn_ranks
from test_grad_layout import same_state
from test_offload_helpers import zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.grads.carry import GradCarry

STEPS, SAVE, BATCH = 12, 6, 8  # intervals [1, 3], [4, 6], ...: saved after two steps of [4, 6]
CASE = {"topk_ratio": 0.25, "update_interval": 3, "overlap_step": True, "select_interval": 6,
        "full_warm_up_rounds": 1, "cpu_threads": 1, "pin_memory": False}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 8))


CLIP = 0.05  # small against these gradients: the run changes with it (asserted)


def _train(layout: str, rank: int, start: dict | None = None, clip: float | None = None) -> dict:
    """This rank's half of each batch, the hook path; the state after ``SAVE`` steps (unless
    resumed from ``start``) and the weights at the end."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS, BATCH, 16, generator=g), torch.randn(STEPS, BATCH, 8, generator=g)
    model, out = _model(), {}
    if start is not None:
        model.load_state_dict(start["model"])
    cfg = zen(**CASE, grad_layout=layout)
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=2e-2, weight_decay=0.01, max_grad_norm=clip,
                          process_group=dist.group.WORLD) as opt:
        assert isinstance(opt.host.grads, GradCarry) == (layout == "carry")
        if start is not None:
            opt.load_state_dict(start["opt"])
        half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        for t in range(SAVE if start is not None else 0, STEPS):
            opt.zero_grad(set_to_none=True)
            opt.prepare_backward(final=True)
            F.mse_loss(model(x[t, half]), y[t, half]).backward()
            opt.step()
            if t + 1 == SAVE and start is None:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
                buf.seek(0)
                out["saved"] = torch.load(buf, weights_only=False)
        opt.flush()
    out["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _fsdp(layout: str, clip: float | None = None, resume_at: int | None = None) -> dict:
    """A tiny Llama narrowed to hidden 64 (tests/offload/test_fsdp.py's), FSDP2-sharded over the
    two ranks, 10 steps of this rank's half of each batch on the hook path: losses and shards.
    ``resume_at``: after that many steps (inside an interval) both state_dicts are taken, a fresh
    sharded model and optimizer load them and run the rest."""
    from zfctl.offload import vocab_matrices
    from zfctl.plan import resolve_plan
    from zfctl.train.fsdp import data_parallel_mesh, parallelize
    from zfctl.train.models.load import load_model

    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_attention_heads=4",
        "model.config.num_key_value_heads=4"])
    mesh = data_parallel_mesh("cpu", 2, replicas=1)
    cfg = zen(**{**CASE, "full_warm_up_rounds": 2, "vocab_select": "rows"}, grad_layout=layout)
    ids = torch.randint(0, 512, (10, 2, 32), generator=torch.Generator().manual_seed(3 + dist.get_rank()))
    losses: list[float] = []
    saved = None
    for steps in ([resume_at, 10] if resume_at else [10]):
        model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=7)
        parallelize(model, mesh, by_row=vocab_matrices(model))
        if saved is not None:
            model.load_state_dict(saved[0])
        with ZenFlowOptimizer(model.named_parameters(), cfg, lr=5e-3, vocab_params=vocab_matrices(model),
                              max_grad_norm=clip, shard_group=mesh.get_group("shard")) as opt:
            assert isinstance(opt.host.grads, GradCarry) == (layout == "carry")
            if saved is not None:
                opt.load_state_dict(saved[1])
            for t in range(len(losses), steps):
                opt.zero_grad(set_to_none=True)
                opt.prepare_backward(final=True)
                loss = model(input_ids=ids[t], labels=ids[t]).loss
                loss.backward()
                opt.step()
                losses.append(loss.item())
            if steps < 10:
                assert opt.pipeline.interval_len > 0  # saved inside an interval
                saved = ({k: v.detach().clone() for k, v in model.state_dict().items()}, opt.state_dict())
                continue
            opt.flush()
    return {"losses": losses, "shards": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        res = {}
        for clip in (None, CLIP):
            slots, carry = _train("slots", rank, clip=clip), _train("carry", rank, clip=clip)
            resumed = _train("carry", rank, start=carry["saved"], clip=clip)
            res[clip] = {"slots": slots, "carry": carry, "resumed": resumed,
                         "fsdp": {layout: _fsdp(layout, clip) for layout in ("slots", "carry")}}
            res[clip]["fsdp"]["resumed"] = _fsdp("carry", clip, resume_at=SAVE)
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_fold_their_columns_into_the_carry_with_the_slots_bits(tmp_path: Path) -> None:
    spawn_ranks(_worker, 2, (2, rendezvous(tmp_path), str(tmp_path)), timeout=240, what="2-rank carry vs slots")
    for rank, clip in ((r, c) for r in range(2) for c in (None, CLIP)):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)[clip]
        slots, carry, resumed = res["slots"], res["carry"], res["resumed"]
        for name, want in slots["weights"].items():
            assert torch.equal(carry["weights"][name], want), (rank, name)
            assert torch.equal(resumed["weights"][name], want), (rank, name)
        assert carry["saved"]["opt"]["counters"]["interval_len"] == 2
        same_state(carry["saved"], slots["saved"])  # this rank's interval sum included
        fsdp = res["fsdp"]
        assert fsdp["carry"]["losses"] == fsdp["slots"]["losses"], rank
        assert fsdp["resumed"]["losses"] == fsdp["slots"]["losses"], rank  # resumed inside an interval
        assert fsdp["slots"]["losses"][0] != fsdp["slots"]["losses"][-1]
        for name, want in fsdp["slots"]["shards"].items():
            assert torch.equal(fsdp["carry"]["shards"][name], want), (rank, name)
            assert torch.equal(fsdp["resumed"]["shards"][name], want), (rank, name)
    for rank in range(2):  # the clip norm changes the run: clipping is active, not a no-op
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert any(not torch.equal(w, res[CLIP]["slots"]["weights"][n]) for n, w in res[None]["slots"]["weights"].items())
        assert res[None]["fsdp"]["slots"]["losses"] != res[CLIP]["fsdp"]["slots"]["losses"]
