"""ZenFlow on FSDP2 shards in zfctl's usual precision: bf16 weights, the optimizer's fp32 master and
moments, gradients reduce-scattered in fp32 (zfctl/train/fsdp.py ``MixedPrecisionPolicy``) and
cast back to bf16. CPU, gloo, test_fsdp.py's small tiny Llama (hidden 64) in bf16, the default
preset with test_fsdp.py's 4-step warm-up (selections at 4 and 12), 16 steps, the hook path on
(``prepare_backward``, sharded.py ``hook_grads``), the loss taken in fp32 from the bf16 logits.

bf16 cannot be compared bit for bit, nor to 1e-4 as fp32 is (test_fsdp.py): the two ranks each
backpropagate half the batch and FSDP2 averages the halves, which is one process accumulating its
micro-batches in another order and precision, and bf16 rounds every activation and gradient.
So the tolerance is measured, not guessed: one process trained on the same global batches split
into 1 or 2 micro-batches (nothing else differs) spreads by 1.2e-3 relative in loss (measured on
this test's runs; 4 micro-batches spread alike: 2 vs 4: 5.5e-4, 1 vs 4: 1.4e-3), and fsdp over 2
ranks lies 2.4e-4 from one process's 2 micro-batches. LOSS_RTOL, 2e-3, is above that spread.

The guard of the column-score all-reduce (sharded.py ``column_scores``) is the selection, not the
loss: without it each rank ranks its own rows' scores, yet the losses stay 1.3e-3 from one
process's 2 micro-batches, inside bf16's spread, while the columns chosen at steps 4 and 12 agree
with one process's on 97.1-97.6% (and between the two ranks on 95.9%) instead of 98.7-99.0% (one
process's splits among themselves) or 99.0-99.9% (fsdp). SELECT_MIN, 98%, sits between.
test_fsdp.py's fp32 losses guard it too (1.4e-3 drift against 1e-4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from proc_helpers import rendezvous, spawn_ranks
from test_fsdp import BATCH, LR, SELECTIONS, STEPS, WARM, _batches, _model

from zfctl.offload import ZenFlowOptimizer, vocab_matrices
from zfctl.offload.config import TuningConfig, ZenFlowConfig

pytestmark = pytest.mark.slow  # 2 one-process runs and one 2-rank run of 16 bf16 steps of a small model

LOSS_RTOL = 2e-3
SELECT_MIN = 0.98
SPLITS = (1, 2)  # one process's micro-batches per step, the reference spread


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits.float()  # the loss in fp32, as a bf16 recipe takes it
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _train(parts: int, world: int = 1) -> dict:
    """Losses and the columns chosen at each selection of one run; ``world`` 2: this rank's half
    of every batch, FSDP2-sharded, in ``parts`` micro-batches."""
    model = _model("bf16")
    group, rank = {}, 0
    if world > 1:
        from zfctl.train.fsdp import data_parallel_mesh, parallelize

        mesh = data_parallel_mesh("cpu", world)
        parallelize(model, mesh, by_row=vocab_matrices(model))
        group, rank = {"shard_group": mesh.get_group("shard")}, dist.get_rank()
    # release_grads off in one process too, the shards' path (fsdp has no release): the comparison
    # is to differ in the micro-batch split only (release changes no arithmetic either way).
    config = ZenFlowConfig(full_warm_up_rounds=WARM, cpu_threads=1,
                           tuning=TuningConfig(pin_memory=False, release_grads=False))
    opt = ZenFlowOptimizer(model.named_parameters(), config, lr=LR, weight_decay=0.01, max_grad_norm=1.0,
                           vocab_params=vocab_matrices(model), **group)
    assert {p.dtype for p in opt.params} == {torch.bfloat16}
    assert opt.host is not None and opt.host.master.dtype == opt.device_state.master.dtype == torch.float32
    data, per = _batches(), BATCH // (parts * world)
    losses, chosen = [], {}
    with opt:
        for t in range(STEPS):
            total = torch.zeros(())
            for m in range(parts):
                lo = (rank * parts + m) * per
                opt.prepare_backward(final=m == parts - 1)
                loss = _loss(model, data[t, lo : lo + per])
                (loss / parts).backward()
                total += loss.detach()
            if world > 1:
                dist.all_reduce(total)
            losses.append(float(total) / (parts * world))
            if opt.step().selection:
                chosen[t] = [i.clone() if i is not None else None for i in opt.device_state.index]
            opt.zero_grad(set_to_none=True)
    return {"losses": losses, "chosen": chosen}


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(_train(1, world), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp_bf16")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = {f"one{p}": _train(p) for p in SPLITS}
    finally:
        torch.set_num_threads(threads)
    spawn_ranks(_worker, 2, (2, rendezvous(out), str(out)), timeout=900, what="2-rank bf16 fsdp training")
    for r in range(2):
        res[f"fsdp{r}"] = torch.load(out / f"rank{r}.pt", weights_only=True)
    return res


def _spread(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _agree(a: dict, b: dict) -> float:
    """The fraction of the columns chosen in ``a`` that ``b`` chose too, over every selection."""
    assert a.keys() == b.keys() == set(SELECTIONS)
    same = total = 0
    for t, cols in a.items():
        for x, y in zip(cols, b[t]):
            if x is not None:
                total += x.numel()
                same += int(torch.isin(x, y).sum())
    return same / total


def test_bf16_fsdp_losses_lie_within_the_micro_batch_split_spread(runs) -> None:
    one, fsdp = runs["one2"]["losses"], runs["fsdp0"]["losses"]
    assert len(fsdp) == STEPS and fsdp == runs["fsdp1"]["losses"]
    splits = [_spread(runs["one1"]["losses"], runs["one2"]["losses"])]
    # The reference: bf16 noise of that size exists (a tighter tolerance would measure noise)
    # and stays below the tolerance.
    assert LOSS_RTOL / 10 < max(splits) < LOSS_RTOL, splits
    assert _spread(fsdp, one) < LOSS_RTOL, (_spread(fsdp, one), splits)
    assert one[-1] < one[0] - 0.5  # it trained


def test_bf16_fsdp_ranks_choose_the_columns_one_process_chooses(runs) -> None:
    r0, r1 = runs["fsdp0"]["chosen"], runs["fsdp1"]["chosen"]
    assert _agree(r0, r1) == 1.0  # every rank ranks the same summed scores
    splits = [_agree(runs["one1"]["chosen"], runs["one2"]["chosen"])]
    assert min(splits) > SELECT_MIN, splits  # the reference: one process's micro-batch splits
    assert _agree(r0, runs["one2"]["chosen"]) > SELECT_MIN, (_agree(r0, runs["one2"]["chosen"]), splits)
