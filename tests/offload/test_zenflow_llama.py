"""The accuracy claim, measured: the shipped tiny Llama trained 200 steps on the shipped alpaca
sample with ZenFlow (topk 0.1, update_interval 4, overlap) ends within 5% of plain AdamW's final
training loss, same seed, same batches.

The tiny Llama starts from random init, so these 200 steps are pre-training, not the fine-tuning
ZenFlow is made for: the first steps move every weight fast, and a CPU update that lands one
interval late overshoots there. ``full_warm_up_rounds=20`` (10% of the run, synchronous full
steps) covers that transient. Measured on this data (lr 3e-3, batch 4 x 64 tokens, mean of the
last 20 losses): AdamW 3.73; ZenFlow overlap W=20 3.69, W=50 3.62, W=0 3.98 (+6.6%); ZenFlow
without overlap, W=0: 3.36 vs AdamW 3.38 with the preset's warm-up + cosine schedule.
"""

from __future__ import annotations

import pytest
import torch
from test_offload_helpers import zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.plan import resolve_plan
from zfctl.train.data.prepare import prepare_data
from zfctl.train.models.load import load_model, load_tokenizer

STEPS, BATCH, TAIL = 200, 4, 20
OVERRIDES = ["data.max_length=64", f"train.micro_batch_size={BATCH}"]


def run(make_opt, plan, data) -> list[float]:
    model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=plan.train.seed)
    opt = make_opt(model)
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(plan.train.seed))
    losses = []
    for step in range(STEPS):
        idx = order[(step * BATCH) % (len(order) - BATCH):][:BATCH].tolist()
        batch = data.collate([data.train[i] for i in idx])
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if hasattr(opt, "close"):
        opt.close()
    return losses


@pytest.mark.slow
def test_tiny_llama_zenflow_matches_adamw_final_loss(tmp_path) -> None:
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=OVERRIDES)
    tok = load_tokenizer(plan.model)
    data = prepare_data(plan.data, tok, seed=plan.train.seed, cache_dir=tmp_path)
    hp = {"lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core box, 2 intra-op threads run 15x slower
    try:
        adamw = run(lambda m: torch.optim.AdamW(m.parameters(), **hp), plan, data)
        cfg = zen(topk_ratio=0.1, update_interval=4, overlap_step=True, full_warm_up_rounds=20)
        zenflow = run(lambda m: ZenFlowOptimizer(m.named_parameters(), cfg, **hp), plan, data)
    finally:
        torch.set_num_threads(threads)

    ref, got = sum(adamw[-TAIL:]) / TAIL, sum(zenflow[-TAIL:]) / TAIL
    print(f"final train loss (mean of last {TAIL} steps): AdamW {ref:.4f}, ZenFlow {got:.4f}, "
          f"start {adamw[0]:.3f}")
    assert adamw[0] - ref > 2.0  # both really trained (from ~ln 4096 = 8.3)
    assert abs(got - ref) <= 0.05 * ref
