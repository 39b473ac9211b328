"""ZenFlow in your own training loop: the README's library example, runnable as it stands.

    python scripts/library_example.py            # CPU, a few seconds; a GPU is used when present

A small Llama (random init, transformers) learns a toy language whose next token is the previous
one plus a per-sequence stride, with ``zfctl.offload.ZenFlowOptimizer`` as its optimizer. Each
line shows the loss, the share of weights updated on the device every step (``sel``: 0 during
the full warm-up, whose steps are synchronous full CPU-offload steps: the CPU AdamW updates every
weight matrix and the step waits for it) and how long ``step()`` waited for the host.
tests/offload/test_library_example.py runs this file and checks that the loss falls and that
ZenFlow engaged after its warm-up.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer, vocab_matrices

VOCAB, SEQ, BATCH = 256, 32, 8


def toy_batches(steps: int, device: torch.device, seed: int = 0):
    """``steps`` batches of sequences start, start + d, start + 2d, ... (mod VOCAB), d in 1..4."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        stride = torch.randint(1, 5, (BATCH, 1), generator=g)
        ids = (start + stride * torch.arange(SEQ)) % VOCAB
        yield {"input_ids": ids.to(device), "labels": ids.to(device)}


def main(steps: int = 30, warm_up: int = 4) -> list[tuple[float, float]]:
    """Train for ``steps``; returns (loss, selected fraction) per step."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         max_position_embeddings=SEQ)).to(device)
    loader = toy_batches(steps, device)

    # The `default` preset's optimizer but for the warm-up: its first full_warm_up_rounds steps
    # (20 by default) are synchronous full CPU-offload steps (the CPU AdamW updates every weight
    # matrix, the step waits: the whole model crosses PCIe both ways), so a 30-step run would barely
    # use ZenFlow's overlapped split.
    # vocab_params names the embedding and output head (vocab_select: rows).
    config = ZenFlowConfig(full_warm_up_rounds=warm_up)
    opt = ZenFlowOptimizer(model.named_parameters(), config, lr=3e-3, weight_decay=0.01, max_grad_norm=1.0,
                           vocab_params=vocab_matrices(model))
    history = []
    try:
        for step, batch in enumerate(loader, 1):
            loss = model(**batch).loss
            opt.prepare_backward(final=True)  # this backward's gradients are final: they leave for the
            #                                   host during it (final=False for earlier micro-batches)
            opt.scale_loss(loss).backward()   # loss scaling for fp16, identity otherwise
            stats = opt.step()                # StepStats: stall_ms, cpu_step_ms, bytes moved, ...
            opt.zero_grad(set_to_none=True)
            value = loss.item()               # a sync point; float(loss) would warn (loss requires grad)
            history.append((value, stats.selected_fraction))
            print(f"step {step:3d}  loss {value:.4f}  sel {stats.selected_fraction:.2f}  "
                  f"stall {stats.stall_ms:.1f} ms", flush=True)
        opt.flush()                           # install the last in-flight CPU update
    finally:
        opt.close()                           # stop the CPU worker thread
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm-up", type=int, default=4, help="zenflow full_warm_up_rounds")
    args = parser.parse_args()
    main(args.steps, args.warm_up)
