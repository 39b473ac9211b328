"""The hook path on FSDP2 shards (zfctl/offload/parallel/sharded.py ``hook_grads``): on the announced last
backward, each decoder layer's reduce-scattered gradient shards go to the host from the DTensors'
post-accumulate-grad hooks, which FSDP2 calls once it has reduced that layer, while the earlier
layers' backward still runs. CPU, gloo, 2 ranks, test_fsdp.py's small tiny Llama (4 layers, hidden
64) in fp32, two micro-batches per rank and step (the second one's hooks see FSDP2's accumulated
``.grad``), test_fsdp.py's 16 steps:

* every loss and every weight bit for bit what the in-step path (a loop that announces no final
  backward, ``prepare_backward(final=False)`` on every micro-batch: the gradients read in step()) gives, for the default preset with test_fsdp.py's 4-step warm-up
  (selections at 4 and 12) and for ``topk_ratio`` 0 with ``update_interval`` 1 (every column on
  the host, a boundary every step);
* each announced step's host chunks all left in the hooks (``early_chunks``), none in step();
* a torch whose FSDP2 does not call those hooks is reported (one warning), not silently slower;
* the hooks fired layer by layer: every matrix of decoder layer ``i`` before layer ``i - 1``'s
  backward began (a backward pre-hook on each layer marks that), the root's (embeddings, head)
  last, and all of them before ``backward()`` returned.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from proc_helpers import rendezvous, spawn_ranks
from test_fsdp import BATCH, LR, STEPS, WARM, _batches, _loss, _model

from zfctl.offload import ZenFlowOptimizer, vocab_matrices
from zfctl.offload.config import TuningConfig, ZenFlowConfig
from zfctl.offload.grads.device_to_host import DuringBackward
from zfctl.train.fsdp import data_parallel_mesh, decoder_layers, parallelize

pytestmark = pytest.mark.slow  # 2 spawned ranks, 4 runs of 16 steps of a small model

CASES: dict[str, dict] = {"default": {}, "zero-offload": {"topk_ratio": 0.0, "update_interval": 1}}
MICRO = 2  # micro-batches per rank and step


def _train(case: str, stream: bool, steps: int = STEPS, unhook: bool = False, device: str = "cpu",
           precision: str = "fp32") -> dict:
    """One rank's run: its losses, its final local weights, the warnings it gave, and (``stream``:
    the loop announces each step's final backward, else none) what the hooks did. ``unhook``: the DTensors' hooks removed, as on a torch whose FSDP2 does
    not call them. ``device`` cuda: also which stream each hook ran on."""
    model = _model(precision, device)
    world = dist.get_world_size()
    mesh = data_parallel_mesh(device, world)
    parallelize(model, mesh, by_row=vocab_matrices(model))
    # accumulate: host named, since auto picks the device accumulator on CUDA for a tiny model,
    # which has no gradient hooks to test (on an H200 the CUDA case failed just so).
    config = ZenFlowConfig(**{"full_warm_up_rounds": WARM, **CASES[case]}, cpu_threads=1, accumulate="host",
                           tuning=TuningConfig(pin_memory=device == "cuda"))
    opt = ZenFlowOptimizer(model.named_parameters(), config, lr=LR, weight_decay=0.01, max_grad_norm=1.0,
                           vocab_params=vocab_matrices(model), shard_group=mesh.get_group("shard"))
    assert isinstance(opt.gradient_path, DuringBackward)
    log: list[tuple] = []  # ("hook", name) / ("layer", i): layer i's backward begins / ("end",)
    streams: set[int] = set()  # cuda: the streams the hooks ran on
    if stream:
        gs = opt.gradient_path.stream
        landed = gs.on_grad

        def on_grad(index: int, p: torch.Tensor) -> None:
            log.append(("hook", opt.names[index]))
            if device == "cuda":
                streams.add(torch.cuda.current_stream().cuda_stream)
            landed(index, p)

        gs.on_grad = on_grad  # type: ignore[method-assign]
        for i, layer in enumerate(decoder_layers(model)):
            layer.register_full_backward_pre_hook(lambda *_, i=i: log.append(("layer", i)))
    if unhook:
        assert opt.sharded is not None
        opt.sharded.close()
    rank, data, per = dist.get_rank(), _batches().to(device), BATCH // (2 * MICRO)
    losses, chunks, logs = [], [], []
    with opt, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for t in range(steps):
            total = torch.zeros(())
            for m in range(MICRO):
                lo = (rank * MICRO + m) * per
                opt.prepare_backward(final=stream and m == MICRO - 1)
                loss = _loss(model, data[t, lo : lo + per])
                log.clear()
                (loss / MICRO).backward()
                log.append(("end",))
                total += loss.detach().float().cpu()
            if world > 1:
                dist.all_reduce(total)
            losses.append(float(total) / (world * MICRO))
            stats = opt.step()
            chunks.append((stats.selection, stats.early_chunks, stats.in_step_chunks, len(opt.transfers.chunks)))
            logs.append(list(log))
            opt.zero_grad(set_to_none=True)
        weights = {n: p.detach().clone() for n, p in zip(opt.names, opt.params)}
    return {"losses": losses, "weights": weights, "chunks": chunks, "logs": logs,
            "warned": [str(w.message) for w in warned if w.category is RuntimeWarning], "streams": streams,
            "host": [opt.names[s.index] for s in opt.layout.host_slots]}


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        res: dict = {(case, stream): _train(case, stream) for case in CASES for stream in (True, False)}
        res["unhooked"] = _train("default", True, steps=3, unhook=True)
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp_stream")
    spawn_ranks(_worker, 2, (2, rendezvous(out), str(out)), timeout=900, what="2-rank fsdp stream training")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_shards_match_the_in_step_path_bit_for_bit(runs, case: str) -> None:
    for res in runs:
        hooked, in_step = res[case, True], res[case, False]
        assert hooked["losses"] == in_step["losses"]
        assert hooked["warned"] == in_step["warned"] == []
        assert in_step["losses"][-1] < in_step["losses"][0] - 0.5  # it trained: not a comparison of noise
        for name, w in hooked["weights"].items():
            assert torch.equal(w, in_step["weights"][name]), name


@pytest.mark.parametrize("case", list(CASES))
def test_every_announced_step_moved_its_host_chunks_in_the_hooks(runs, case: str) -> None:
    for res in runs:
        steps = res[case, True]["chunks"]
        streamed = [(e, s, n) for sel, e, s, n in steps if not sel]  # a selection step reads .grad in step()
        assert len(streamed) >= STEPS - 2
        assert all(e == n > 0 and s == 0 for e, s, n in streamed), streamed


@pytest.mark.parametrize("case", list(CASES))
def test_the_hooks_fire_layer_by_layer_during_backward(runs, case: str) -> None:
    res = runs[0][case, True]
    host = res["host"]
    for sel, log in zip((c[0] for c in res["chunks"]), res["logs"]):
        if sel:
            continue
        hooks = [e[1] for e in log if e[0] == "hook"]
        assert sorted(hooks) == sorted(host)  # each host matrix once
        assert log[-1] == ("end",)
        at = {e: i for i, e in enumerate(log)}
        layers = sorted({int(n.split(".")[2]) for n in host if n.startswith("model.layers.")})
        assert len(layers) == 4
        for i in layers:
            mine = [at["hook", n] for n in host if n.startswith(f"model.layers.{i}.")]
            assert mine and max(mine) < at.get(("layer", i - 1), at["end",]), (i, log)
            if i + 1 in layers:  # and after the layer above's backward began: per layer, not all at the end
                assert min(mine) > at["layer", i + 1]
        root = [at["hook", n] for n in host if not n.startswith("model.layers.")]
        assert root and min(root) > at["layer", 0]


def test_hooks_that_never_fire_are_reported_once_and_step_moves_the_gradients(runs) -> None:
    """A torch whose FSDP2 does not call the sharded parameters' hooks: the same losses (step()
    lands every chunk), one RuntimeWarning saying the overlap is lost."""
    for res in runs:
        unhooked = res["unhooked"]
        assert unhooked["losses"] == res["default", True]["losses"][:3]
        assert [(e, s == n) for _, e, s, n in unhooked["chunks"]] == [(0, True)] * 3
        assert len(unhooked["warned"]) == 1 and "no gradient reached the host during backward" in unhooked["warned"][0]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_rank_streams_from_the_reduce_stream_bit_for_bit(tmp_path, device: str) -> None:
    """One FSDP2 rank in this process (gloo on CPU; on CUDA, NCCL and bf16): the same bits as the
    in-step path, every host chunk landed in a hook, and on CUDA every hook ran on FSDP2's
    post-reduce stream, not the default stream (the copy stream waits on that one, stream.py)."""
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=rendezvous(tmp_path), rank=0,
                            world_size=1)
    try:
        precision = "bf16" if device == "cuda" else "fp32"
        hooked = _train("default", True, device=device, precision=precision)
        in_step = _train("default", False, device=device, precision=precision)
    finally:
        dist.destroy_process_group()
    assert hooked["losses"] == in_step["losses"]
    for name, w in hooked["weights"].items():
        assert torch.equal(w, in_step["weights"][name]), name
    assert all(e == n > 0 and s == 0 for sel, e, s, n in hooked["chunks"] if not sel)
    if device == "cuda":
        assert hooked["streams"] and torch.cuda.default_stream().cuda_stream not in hooked["streams"]
