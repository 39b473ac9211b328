"""Data parallel on NCCL, 2 GPUs (skipped with fewer): the hook exchange, uneven reduce-scatter, a
parameter without a gradient on one rank, resharding 2 -> 1, and helper threads on the right GPU.

The CPU counterparts run on gloo (tests/offload/test_offload_collective_order.py, tests/offload/test_distributed.py);
these check what only NCCL does: collectives on their own stream, a device-side ``work.wait()``.
Every run names its gradient path (``PATHS``): on CUDA ``accumulate: auto`` picks the device path
for a tiny model, whose gradients never leave in the hooks, so the hook exchange (and the held-back
order for ``side``, which rank 1 never grades) is only exercised with ``accumulate: host``, and
page-locked memory only with ``pin_memory: true``. The hook run also makes every implicit sync an
error outside warm-up and selection steps (the exchange plans its rounds at the selection, not in
the next backward's hooks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from proc_helpers import rendezvous, spawn_ranks

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py); with one GPU, skipped below

WORLD = 2
PATHS = {"host": {"accumulate": "host", "pin_memory": True},
         "device": {"accumulate": "device", "pin_memory": True}}


def _gpus_with_context() -> set[int]:
    """Indices of the GPUs on which this process holds a CUDA (primary) context, asked of the
    driver in-process: nvidia-smi's process list shows host PIDs, or none, inside a container."""
    import ctypes

    libcuda = ctypes.CDLL("libcuda.so.1")  # loaded by torch already; cuInit done
    used = set()
    for i in range(torch.cuda.device_count()):
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert libcuda.cuDeviceGet(ctypes.byref(dev), i) == 0, i
        assert libcuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0, i
        if active.value:
            used.add(i)
    return used


def _worker(rank: int, init: str, out: str) -> None:
    from test_offload_collective_order import _train

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=WORLD)
    try:
        res = {"hooks": _train([rank], WORLD, hooks=True, group=dist.group.WORLD, device="cuda", extra=PATHS["host"],
                               no_syncs=True),
               "step": _train([rank], WORLD, hooks=False, group=dist.group.WORLD, device="cuda", extra=PATHS["host"]),
               "device": _train([rank], WORLD, hooks=False, group=dist.group.WORLD, device="cuda",
                                extra=PATHS["device"])}
        res["resumed"], res["straight"] = _reshard(rank)
        res["gpus"] = sorted(_gpus_with_context())
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _reshard(rank: int) -> tuple[dict | None, dict]:
    """2 ranks train 10 steps straight; 2 ranks train 5, save their states, and rank 0 alone
    continues from both states (merged pieces) for 5 more: the 1-process continuation."""
    from test_offload_collective_order import CFG, Net, _data
    from test_offload_helpers import zen

    from zfctl.offload import ZenFlowOptimizer
    from zfctl.offload.parallel.pieces import merge_states

    def steps(model, opt, lo, hi, ranks):
        x, y = _data()
        for t in range(lo, hi):
            for r in ranks:
                xs, ys = x[t, r * 4 : (r + 1) * 4].cuda(), y[t, r * 4 : (r + 1) * 4].cuda()
                (torch.nn.functional.mse_loss(model(xs, True), ys) / len(ranks)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def make(group):
        torch.manual_seed(0)
        model = Net().cuda()
        return model, ZenFlowOptimizer(model.named_parameters(), zen(**{**CFG, **PATHS["host"]}), lr=5e-3,
                                       max_grad_norm=0.5, process_group=group)

    model, opt = make(dist.group.WORLD)
    with opt:
        steps(model, opt, 0, 10, [rank])
        opt.flush()
    straight = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    model, opt = make(dist.group.WORLD)
    with opt:
        steps(model, opt, 0, 5, [rank])
        states: list = [None] * WORLD
        dist.all_gather_object(states, _to_cpu(opt.state_dict()))  # every rank's pieces, on the host
        msd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if rank != 0:
        return None, straight
    torch.manual_seed(1)
    model, opt = make(None)
    model.load_state_dict(msd)
    with opt:
        opt.load_state_dict(merge_states(states, opt.host_ranges()))
        steps(model, opt, 5, 10, list(range(WORLD)))
        opt.flush()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, straight


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def test_nccl_hook_exchange_reshard_and_thread_devices(tmp_path: Path) -> None:
    from test_offload_collective_order import _train

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")

    spawn_ranks(_worker, WORLD, (rendezvous(tmp_path), str(tmp_path)), timeout=300,
                what="the two NCCL ranks (their collectives did not match)")
    ref = _train(list(range(WORLD)), 1, hooks=False, device="cuda", extra=PATHS["host"])
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert all(torch.equal(res["hooks"][k], res["step"][k]) for k in ref), rank
        for k in ref:
            assert float((res["hooks"][k] - ref[k]).norm() / ref[k].norm()) <= 1e-5, (rank, k)
            assert float((res["device"][k] - ref[k]).norm() / ref[k].norm()) <= 1e-5, (rank, k)
        assert res["gpus"] == [rank], res["gpus"]  # no helper thread made a context on another GPU
    res0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for k, v in res0["straight"].items():
        assert float((res0["resumed"][k] - v).norm() / v.norm()) <= 1e-5, k
