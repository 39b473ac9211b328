"""Time ``zfctl.train.checkpoint.save_checkpoint`` for a model + optimizer-sized state.

    OMP_NUM_THREADS=1 python scripts/bench_checkpoint.py --model tiny-llama --dir /dev/shm/ckb
    OMP_NUM_THREADS=1 python scripts/bench_checkpoint.py --model 100m --dir /tmp/ckb --repeats 3

``tiny-llama`` is the preset's 5.3M-param Llama; ``100m`` a 12-layer, 768-wide Llama (~100M
params, fp32). The optimizer state is fp32 tensors of the size ZenFlow saves (master + two
moments + accumulator, 16 B/param), so the numbers time the writer, not the optimizer. Each
repeat saves a new step (keep_last 1); the median wall time is printed with MB/s. Point
PYTHONPATH at another checkout to time its writer (the same script, the same state).

``--compare-writers`` times, interleaved in one process (so a busy machine's noise hits both
alike), the two ways to write the same files: plain ``torch.save`` + ``safetensors.save_model``
(no digests) against zfctl's hashing writers (digest while writing, finite-weights check).
"""

from __future__ import annotations

import argparse
import inspect
import os
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
    ap.add_argument("--compare-writers", action="store_true", help="plain vs hashing writers, interleaved")
    args = ap.parse_args()
    from zfctl.train import checkpoint as ck

    model = build(args.model)
    n = sum(p.numel() for p in model.parameters())
    opt_state = {"state": {i: {"master": p.detach().float().clone(), "exp_avg": torch.randn(p.shape),
                               "exp_avg_sq": torch.rand(p.shape), "acc": torch.randn(p.shape)}
                           for i, p in enumerate(model.parameters())}}
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.compare_writers:
        compare_writers(model, opt_state, args.dir, args.repeats, n)
        return
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


def compare_writers(model: torch.nn.Module, opt_state: dict, folder: Path, repeats: int, n: int) -> None:
    from safetensors.torch import save_model

    from zfctl.train.checksum import save_model_hashed, save_torch_hashed

    def plain(path: Path) -> None:
        with open(path / "optimizer.pt", "wb") as f:
            torch.save(opt_state, f)
            f.flush()
            os.fsync(f.fileno())
        save_model(model, str(path / "model.safetensors"))
        fd = os.open(path / "model.safetensors", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def hashed(path: Path) -> None:
        save_torch_hashed(opt_state, path / "optimizer.pt")
        save_model_hashed(model, path / "model.safetensors", {"format": "pt"})

    folder.mkdir(parents=True)
    times: dict[str, list[float]] = {"plain": [], "hashed": []}
    for r in range(repeats + 1):
        for name, fn in (("plain", plain), ("hashed", hashed)) if r % 2 else (("hashed", hashed), ("plain", plain)):
            t0 = time.perf_counter()
            fn(folder)
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in folder.iterdir())
    shutil.rmtree(folder, ignore_errors=True)
    p, h = statistics.median(times["plain"]), statistics.median(times["hashed"])
    print(f"{n / 1e6:.1f}M params, {size / 1e6:.0f} MB: plain writers median {p * 1e3:.0f} ms (min "
          f"{min(times['plain']) * 1e3:.0f}), hashing writers median {h * 1e3:.0f} ms (min "
          f"{min(times['hashed']) * 1e3:.0f}): {(h / p - 1) * 100:+.1f}% median, "
          f"{(min(times['hashed']) / min(times['plain']) - 1) * 100:+.1f}% min, {repeats} rounds")


if __name__ == "__main__":
    main()
