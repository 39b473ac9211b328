"""Peak host memory of `zfctl export` from an FSDP2-sharded checkpoint vs the same state unsharded.

Two gloo ranks train a ~110M-parameter Llama (fp32) 3 steps under FSDP2 with ZenFlow and write a
sharded checkpoint (checkpoint/shards.py); the same state is then written the one-process way
(whole weights, ``unshard_state``). Each export runs in a fresh process that reports its peak RSS
(``VmHWM``), beside a process that only loads the model (the floor: one model copy).

    PYTHONPATH=. .venv/bin/python scripts/shard_export_memory.py [--world 2]

Numbers: docs/design.md, "Checkpoint format".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

OVERRIDES = [
    "model.config.hidden_size=1024", "model.config.intermediate_size=2752", "model.config.num_hidden_layers=8",
    "model.config.num_attention_heads=16", "model.config.num_key_value_heads=16",
    "train.device=cpu", "train.precision=fp32", "zenflow.update_interval=2", "zenflow.overlap_step=true",
    "zenflow.full_warm_up_rounds=0", "zenflow.cpu_threads=1", "zenflow.tuning.pin_memory=false",
]


def _plan():
    from zfctl.plan import resolve_plan

    return resolve_plan("tiny-llama", "alpaca-sample", overrides=OVERRIDES)


def _meta(path: Path, world: int) -> None:
    from zfctl.train.checksum import file_digest

    files = sorted(p.name for p in path.iterdir() if p.name != "meta.json")
    (path / "meta.json").write_text(json.dumps({
        "zfctl_version": "measure", "step": 3, "world_size": world, "hash": "xxh3_128",
        "files": {n: (path / n).stat().st_size for n in files}, "digests": {n: file_digest(path / n) for n in files}}))


def _rank(rank: int, world: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from zfctl.offload import vocab_matrices
    from zfctl.plan.io import dump_plan_yaml
    from zfctl.train import checkpoint as ck
    from zfctl.train.fsdp import data_parallel_mesh, parallelize
    from zfctl.train.models.load import load_model
    from zfctl.train.optim import build_optimizer
    from zfctl.train.tensorfile import save_state_hashed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rdzv", rank=rank, world_size=world)
    plan, ckpt = _plan(), Path(out) / "sharded"
    model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=0)
    parallelize(model, data_parallel_mesh("cpu", world), by_row=vocab_matrices(model))
    opt = build_optimizer(model, plan, steps_per_epoch=100, shard_group=dist.group.WORLD)
    ids = torch.randint(0, 4096, (3, 1, 16), generator=torch.Generator().manual_seed(rank))
    for t in range(3):
        logits = model(input_ids=ids[t]).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[t, :, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ckpt.mkdir(exist_ok=True)
    dist.barrier()
    ck.save_model_shard(model, ckpt / ck.model_shard_file(rank), step=3, rank=rank, world=world)
    save_state_hashed(opt.state_dict(), ckpt / ck.optimizer_file(rank))
    opt.close()
    dist.barrier()
    if rank == 0:
        torch.save({ck.STEP_KEY: 3, ck.STEPS_PER_EPOCH_KEY: 100}, ckpt / ck.TRAINER_FILE)
        dump_plan_yaml(plan, ckpt / ck.PLAN_FILE)
        _meta(ckpt, world)
    dist.destroy_process_group()


def _unsharded(out: Path, world: int) -> None:
    import shutil

    from safetensors.torch import save_file

    from zfctl.offload.parallel.sharded import unshard_state
    from zfctl.train import checkpoint as ck
    from zfctl.train.tensorfile import load_state, save_state_hashed

    src, dst = out / "sharded", out / "plain"
    dst.mkdir()
    info = ck.read_checkpoint(src)
    save_file(dict(ck.full_tensors(info)), dst / ck.MODEL_FILE, {"format": "pt"})
    save_state_hashed(unshard_state([load_state(src / ck.optimizer_file(r), lazy=False) for r in range(world)]),
                      dst / ck.optimizer_file(0))
    for name in (ck.TRAINER_FILE, ck.PLAN_FILE):
        shutil.copy(src / name, dst / name)
    _meta(dst, 1)


def _measure(what: str, out: Path) -> None:
    import torch

    from zfctl.train import checkpoint as ck
    from zfctl.train import export

    if what == "floor":  # one model copy: built and loaded, nothing else
        from zfctl.train.models.load import load_model

        plan = _plan()
        model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=0)
        ck.load_model_weights(ck.read_checkpoint(out / "sharded"), model)
    elif what == "save":  # the floor and transformers' save_pretrained of it: export without the install
        from zfctl.train.models.load import load_model

        plan = _plan()
        model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=0)
        ck.load_model_weights(ck.read_checkpoint(out / "sharded"), model)
        model.save_pretrained(out / "export-save")
    else:
        export(out / what, out / f"export-{what}")
    # VmHWM, not ru_maxrss: the latter is inherited from the (large) parent across fork and exec
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    print(int(hwm.split()[1]) * 1024)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if args.child:
        _measure(args.child[0], Path(args.child[1]))
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        mp.spawn(_rank, args=(args.world, str(out)), nprocs=args.world)
        subprocess.run([sys.executable, __file__, "--child", "floor", str(out)], check=True, capture_output=True)
        _unsharded(out, args.world)
        peaks = {}
        for what in ("floor", "save", "sharded", "plain"):
            r = subprocess.run([sys.executable, __file__, "--child", what, str(out)], check=True,
                               capture_output=True, text=True)
            peaks[what] = int(r.stdout.split()[-1])
        weights = sum((out / "sharded" / f).stat().st_size for f in (out / "sharded").iterdir() if f.name.startswith("model-"))
        opt = sum((out / "sharded" / f).stat().st_size for f in (out / "sharded").iterdir() if f.name.startswith("optimizer-"))
        mb = 1e6
        print(f"weights {weights / mb:.0f} MB, optimizer states {opt / mb:.0f} MB over {args.world} ranks")
        for what, peak in peaks.items():
            print(f"peak RSS {what:8s} {peak / mb:8.0f} MB  (+{(peak - peaks['floor']) / mb:.0f} MB over the floor)")


if __name__ == "__main__":
    main()
