"""zfctl/train/fsdp.py and the engine's refusals (zfctl/offload/parallel/sharded.py), in one process: a
1-rank gloo group is enough for FSDP2 to wrap and place (the 2- and 4-rank numerics are
tests/offload/test_fsdp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from zfctl.errors import ConfigError
from zfctl.offload import ZenFlowOptimizer, vocab_matrices
from zfctl.offload.config import TuningConfig, ZenFlowConfig
from zfctl.plan import resolve_plan
from zfctl.train.fsdp import check_shardable, decoder_layers, parallelize
from zfctl.train.models.load import load_model


def _llama() -> torch.nn.Module:
    plan = resolve_plan("tiny-llama", "alpaca-sample")
    return load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=0)


@pytest.fixture
def group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_decoder_layers_are_the_largest_module_list() -> None:
    model = _llama()
    assert decoder_layers(model) is model.model.layers
    assert decoder_layers(torch.nn.Sequential(torch.nn.Linear(4, 4))) is None


def test_check_shardable_refuses_what_fsdp_cannot_shard() -> None:
    with pytest.raises(ConfigError, match="distributed.strategy.*no list of decoder layers"):
        check_shardable(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2, [])
    model = _llama()
    check_shardable(model, 4, vocab_matrices(model))  # 256, 688, 4096: all divide by 4
    with pytest.raises(ConfigError, match=r"distributed.nproc.*mlp.gate_proj.weight \(dim 0 of size 688\)"):
        check_shardable(model, 32, [])  # 4096 and 256 divide by 32, 688 = 16 x 43 does not


def test_parallelize_shards_each_weight_on_zenflows_row_dim(group) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = _llama()
    by_row = vocab_matrices(model)
    parallelize(model, init_device_mesh("cpu", (1,)), by_row=by_row)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    assert len(placements) == len(list(model.parameters()))
    assert placements["model.embed_tokens.weight"] == placements["lm_head.weight"] == (Shard(1),)
    assert placements["model.layers.0.mlp.down_proj.weight"] == (Shard(0),)
    cfg = ZenFlowConfig(cpu_threads=1, tuning=TuningConfig(pin_memory=False))
    with ZenFlowOptimizer(model.named_parameters(), cfg, vocab_params=by_row, shard_group=group) as opt:
        local = dict(opt.sharded.local) if opt.sharded is not None else {}
        # The engine's tensors alias the shards FSDP2 all-gathers from: an in-place write reaches them.
        w = model.get_parameter("model.layers.0.mlp.down_proj.weight")
        local["model.layers.0.mlp.down_proj.weight"].data.fill_(0.5)
        assert bool((w.to_local() == 0.5).all())
    # By-row matrices sharded on dim 0 would split ZenFlow's columns: refused.
    cfg_cols = ZenFlowConfig(cpu_threads=1, vocab_select="columns", tuning=TuningConfig(pin_memory=False))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight.*Shard\(0\)"):
        ZenFlowOptimizer(model.named_parameters(), cfg_cols, vocab_params=by_row, shard_group=group)


def test_a_plain_tensor_under_shard_group_is_refused(group) -> None:
    with pytest.raises(TypeError, match="not an FSDP2 DTensor"):
        ZenFlowOptimizer([("w", torch.nn.Parameter(torch.ones(4, 4)))], shard_group=group)
    with pytest.raises(ValueError, match="not both"):
        ZenFlowOptimizer([("w", torch.nn.Parameter(torch.ones(4, 4)))], shard_group=group, process_group=group)


def test_a_sharded_state_loads_only_into_the_same_shard(group) -> None:
    """FSDP2 row state is this rank's rows: refused by an optimizer of another shape of group."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = ZenFlowConfig(cpu_threads=1, tuning=TuningConfig(pin_memory=False))
    model = _llama()
    parallelize(model, init_device_mesh("cpu", (1,)), by_row=vocab_matrices(model))
    with ZenFlowOptimizer(model.named_parameters(), cfg, vocab_params=vocab_matrices(model), shard_group=group) as opt:
        sd = opt.state_dict()
        assert sd["fsdp_shard"] == [0, 1]
    plain = _llama()
    with ZenFlowOptimizer(plain.named_parameters(), cfg, vocab_params=vocab_matrices(plain)) as opt, \
            pytest.raises(ValueError, match=r"FSDP2 shard \(rank, world size\) \[0, 1\] cannot load into None"):
        opt.load_state_dict(sd)
