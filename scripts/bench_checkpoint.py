"""Time ``zfctl.train.checkpoint.save_checkpoint`` for a model + optimizer-sized state.

    OMP_NUM_THREADS=1 python scripts/bench_checkpoint.py --model tiny-llama --dir /dev/shm/ckb
    OMP_NUM_THREADS=1 python scripts/bench_checkpoint.py --model 100m --dir /tmp/ckb --repeats 3

``tiny-llama`` is the preset's 5.3M-param Llama; ``100m`` a 12-layer, 768-wide Llama (~100M
params, fp32). The optimizer state is fp32 tensors of the size ZenFlow saves (master + two
moments + accumulator, 16 B/param), so the numbers time the writer, not the optimizer. Each
repeat saves a new step (keep_last 1); the median wall time is printed with MB/s. Point
PYTHONPATH at another checkout to time its writer (the same script, the same state).
"""

from __future__ import annotations

import argparse
import inspect
import shutil
import statistics
import time
from pathlib import Path

import torch


def build(name: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if name == "tiny-llama":
        cfg = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 8}
    else:
        cfg = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
               "num_attention_heads": 12, "num_key_value_heads": 12}
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny-llama", "100m"], default="tiny-llama")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/zfctl-ckpt-bench"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from zfctl.train import checkpoint as ck

    model = build(args.model)
    n = sum(p.numel() for p in model.parameters())
    opt_state = {"state": {i: {"master": p.detach().float().clone(), "exp_avg": torch.randn(p.shape),
                               "exp_avg_sq": torch.rand(p.shape), "acc": torch.randn(p.shape)}
                           for i, p in enumerate(model.parameters())}}
    shutil.rmtree(args.dir, ignore_errors=True)
    kw = {"estimate": 0} if "estimate" in inspect.signature(ck.save_checkpoint).parameters else {}
    times = []
    for step in range(1, args.repeats + 2):
        t0 = time.perf_counter()
        path = ck.save_checkpoint(args.dir, step, model=model, optimizer_state=opt_state,
                                  trainer_state={"step": step}, keep_last=1,
                                  write_plan=lambda p: p.write_text("train: {}\n"), **kw)
        if step > 1:  # the first save warms the allocator and the page cache
            times.append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in path.iterdir())
    med = statistics.median(times)
    print(f"{args.model}: {n / 1e6:.1f}M params, {size / 1e6:.0f} MB per checkpoint, save median "
          f"{med * 1e3:.0f} ms (min {min(times) * 1e3:.0f}, max {max(times) * 1e3:.0f}), "
          f"{size / med / 1e6:.0f} MB/s, {args.repeats} repeats, {ck.__file__}")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
