"""The plan layer: io round trips, coercion, validation, resolution order, DeepSpeed import, memory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from zfctl.errors import ConfigError, UserError
from zfctl.plan import dump_plan_yaml, load_plan_yaml, plan_from_dict, plan_to_dict, resolve_plan
from zfctl.plan.deepspeed import from_deepspeed
from zfctl.plan.memory import GB, Machine, estimate
from zfctl.plan.overrides import parse_override
from zfctl.plan.schema import RunPlan
from zfctl.plan.sizes import _built_size, _llama_size

# DeepSpeedExamples' ZenFlow fine-tuning config (training/DeepSpeed-ZenFlow/finetuning/zf_config.json),
# its zenflow section as published there.
REFERENCE_DS = {
    "train_batch_size": 8,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "zenflow": {"topk_ratio": 0.1, "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True},
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    },
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_allow_untested_optimizer": True,
    "wall_clock_breakdown": False,
}


def test_dict_and_yaml_round_trip_exactly(tmp_path: Path) -> None:
    plan = resolve_plan(
        "tiny-llama", "sst2-sample", overrides=["train.betas=[0.8, 0.95]", "zenflow.update_interval=auto"]
    )
    assert plan_from_dict(plan_to_dict(plan)) == plan
    path = tmp_path / "run" / "plan.yaml"
    dump_plan_yaml(plan, path)
    assert load_plan_yaml(path) == plan
    text = path.read_text()
    # self-documenting: the help text of a field precedes it; nothing half-written left around
    assert "# Fraction of the columns of every 2-D weight" in text
    assert [p.name for p in path.parent.iterdir()] == ["plan.yaml"]
    old_umask = os.umask(0o022)
    try:
        dump_plan_yaml(plan, tmp_path / "umask" / "plan.yaml")
    finally:
        os.umask(old_umask)
    assert (tmp_path / "umask" / "plan.yaml").stat().st_mode & 0o777 == 0o644  # like any file, not 0600
    assert yaml.safe_load(text)["train"]["betas"] == [0.8, 0.95]
    assert plan.train.betas == (0.8, 0.95) and plan.data.label_names == ["negative", "positive"]


def test_values_are_coerced_to_schema_types() -> None:
    plan = plan_from_dict(
        {
            "model": {"config": {"model_type": "llama"}},
            "train": {"lr": "2e-5", "betas": ["0.9", 0.98], "max_steps": 100.0, "max_grad_norm": None},
            "zenflow": {
                "update_interval": "auto",
                "select_interval": "2 Epoch",
                "overlap_step": "false",
                "tuning": {"ring_slots": "2", "ring_slot_mb": 8},
            },
        }
    )
    assert plan.train.lr == pytest.approx(2e-5) and isinstance(plan.train.lr, float)
    assert plan.train.betas == (0.9, 0.98)
    assert plan.train.max_steps == 100 and isinstance(plan.train.max_steps, int)
    assert plan.train.max_grad_norm is None
    assert plan.zenflow.update_interval == "auto" and plan.zenflow.select_interval == "2 epochs"
    assert plan.zenflow.overlap_step is False
    assert (plan.zenflow.tuning.ring_slots, plan.zenflow.tuning.ring_slot_mb) == (2, 8.0)
    assert isinstance(plan.zenflow.tuning.ring_slot_mb, float)


@pytest.mark.parametrize(
    "data, key, words",
    [
        ({"zenflow": {"topk_ration": 0.2}}, "zenflow.topk_ration", "did you mean zenflow.topk_ratio"),
        ({"trian": {"lr": 1}}, "trian", "did you mean train"),
        ({"train": {"max_steps": 1.5}}, "train.max_steps", "expected an integer"),
        ({"train": {"precision": "bfloat16"}}, "train.precision", "did you mean bf16"),
        ({"train": {"micro_batch_size": True}}, "train.micro_batch_size", "expected an integer"),
        ({"train": {"betas": [0.9, "x"]}}, "train.betas[1]", "expected a number"),
        ({"train": {"betas": [0.9, 1.0]}}, "train.betas", "[0, 1)"),
        ({"train": {"lr": 0}}, "train.lr", "must be > 0"),
        ({"zenflow": {"topk_ratio": -0.1}}, "zenflow.topk_ratio", "[0, 1]"),
        ({"zenflow": {"update_interval": 0}}, "zenflow.update_interval", "in [1, 64]"),
        ({"zenflow": {"select_interval": 2, "update_interval": 4}}, "zenflow.select_interval", ">= update_interval"),
        ({"zenflow": {"select_interval": "0 epochs"}}, "zenflow.select_interval", "auto, epoch or 'N epochs'"),
        ({"zenflow": {"tuning": {"ring_slot": 2}}}, "zenflow.tuning.ring_slot", "did you mean zenflow.tuning.ring_slots"),
        ({"zenflow": {"ring_slot": 2}}, "zenflow.ring_slot", "did you mean zenflow.tuning.ring_slots"),
        ({"zenflow": {"tuning": {"auto_min_interval": 4, "auto_max_interval": 2}}},
         "zenflow.tuning.auto_max_interval", ">= tuning.auto_min_interval (4)"),
        ({"data": {"end_idx": 0}}, "data.end_idx", "greater than data.start_idx"),
        ({"data": {"template": "classification"}}, "data.label_names", ">= 2 label words"),
        ({"data": {"packing": True}}, "data.packing", "templates text and chat"),
        ({"data": {"source": "hub"}}, "data.path", "needs a path"),
        ({"model": {"source": "hub"}}, "model.hub_id", "needs a hub id"),
        ({"model": {"source": "config"}}, "model.config", "needs the architecture"),
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last", ">= 1"),
        ({"distributed": {"timeout": 0}}, "distributed.timeout", "> 0 seconds"),
        (
            {"distributed": {"backend": "nccl"}, "train": {"device": "cpu"}},
            "distributed.backend",
            "needs CUDA",
        ),
    ],
)
def test_bad_values_name_the_dotted_key(data: dict, key: str, words: str) -> None:
    base = {"model": {"config": {"model_type": "llama"}}}
    merged = {**base, **data} if "model" not in data else data
    with pytest.raises(ConfigError) as info:
        plan_from_dict(merged)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}=") and words in str(info.value)


def test_resolution_order_presets_config_set_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "my.yaml"
    cfg.write_text("train:\n  lr: 1.0e-3\n  warmup_steps: 7\nzenflow:\n  topk_ratio: 0.3\n")
    plan = resolve_plan(
        "tiny-llama",
        "alpaca-sample",
        zenflow="aggressive",
        config=cfg,
        overrides=["train.lr=5e-4", "model.config.num_hidden_layers=2", "train.max_steps=9"],
        flags={"train": {"max_steps": 3}},
    )
    assert plan.data.max_length == 128  # data preset over the schema default
    assert plan.zenflow.update_interval == 8  # zenflow preset
    assert plan.zenflow.topk_ratio == 0.3  # config file over the zenflow preset
    assert plan.train.warmup_steps == 7  # config file over the model preset
    assert plan.train.lr == 5e-4  # --set over the config file
    assert plan.train.max_steps == 3  # flags over --set
    assert plan.model.config["num_hidden_layers"] == 2  # nested --set keeps the other keys
    assert plan.model.config["hidden_size"] == 256
    assert plan.checkpoint.output_dir == "runs/tiny-llama-alpaca-sample"


def test_overrides_parse_yaml_values() -> None:
    assert parse_override("train.max_steps=null") == {"train": {"max_steps": None}}
    assert parse_override("zenflow.overlap_step=false") == {"zenflow": {"overlap_step": False}}
    assert parse_override("train.betas=[0.9,0.95]") == {"train": {"betas": [0.9, 0.95]}}
    for bad in ("train.lr", "lr=1", "=1", "train..lr=1"):
        with pytest.raises(ConfigError, match="--set"):
            parse_override(bad)


def test_deepspeed_reference_config_resolves_to_expected_plan(tmp_path: Path) -> None:
    path = tmp_path / "zf_config.json"
    path.write_text(json.dumps(REFERENCE_DS))
    notes: list[str] = []
    plan = resolve_plan("llama2-7b", "alpaca", config=path, notes=notes)
    z, t = plan.zenflow, plan.train
    assert (z.topk_ratio, z.update_interval, z.full_warm_up_rounds, z.overlap_step, z.tuning.pin_memory) == (
        0.1,
        4,
        0,
        True,
        True,
    )
    assert (z.select_interval, z.deferred_lr_scale, z.vocab_select) == ("auto", "off", "columns")
    assert (t.lr, t.betas, t.eps, t.weight_decay) == (2e-5, (0.9, 0.999), 1e-8, 0.01)
    assert (t.precision, t.max_grad_norm, t.gradient_accumulation_steps) == ("bf16", 1.0, 1)
    assert t.micro_batch_size == 8  # train_batch_size 8 with no micro size: one process takes all 8
    joined = "\n".join(notes)
    assert "zero_allow_untested_optimizer" in joined and "wall_clock_breakdown" in joined
    assert "train_batch_size 8" in joined
    assert "offload_optimizer.pin_memory read as zenflow.tuning.pin_memory" in joined


def test_set_off_reaches_a_literal_that_has_off(tmp_path: Path) -> None:
    """`--set zenflow.deferred_lr_scale=off` (YAML reads a bare off as false) is the 'off' mode,
    in a config file too; a bool stays an error where the choices have no 'off'."""
    cfg = tmp_path / "my.yaml"
    cfg.write_text("zenflow:\n  deferred_lr_scale: off\n")
    assert resolve_plan("tiny-llama", "alpaca-sample", config=cfg).zenflow.deferred_lr_scale == "off"
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=["zenflow.deferred_lr_scale=off"])
    assert plan.zenflow.deferred_lr_scale == "off"
    with pytest.raises(ConfigError, match="zenflow.accumulate"):
        resolve_plan("tiny-llama", "alpaca-sample", overrides=["zenflow.accumulate=off"])


def test_deepspeed_defaults_and_baselines() -> None:
    # a zenflow block means DeepSpeed's defaults for what it leaves out
    zf = from_deepspeed(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {}}}
    )
    assert zf.fragment["zenflow"] == {"overlap_step": False, "update_interval": "auto", "select_interval": "auto",
                                      "full_warm_up_rounds": 0, "deferred_lr_scale": "off",
                                      "vocab_select": "columns", "tuning": {"install_lag": 0}}
    # cpu offload without zenflow = ZeRO-Offload; no offload = everything on the device
    zo = from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert zo.fragment["zenflow"] == {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False}
    assert from_deepspeed({"bf16": {"enabled": True}}).fragment["zenflow"] == {"topk_ratio": 1.0}
    # HF-Trainer-style "auto" values leave the plan's own settings alone
    auto = from_deepspeed(
        {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        }
    )
    assert "train" not in auto.fragment
    ignored = from_deepspeed(
        {"zero_optimization": {"stage": 2, "overlap_comm": True, "offload_optimizer": {"device": "cpu"}}}
    )
    assert any("zero_optimization.overlap_comm" in n for n in ignored.notes)


@pytest.mark.parametrize(
    "ds, key",
    [
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled"),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
            "zero_optimization.offload_optimizer.device",
        ),
        (
            {"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}},
            "zero_optimization.offload_optimizer.device",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu"},
                    "zenflow": {"topk": 0.1},
                }
            },
            "zero_optimization.zenflow.topk",
        ),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                "zenflow": {"select_strategy": "bogus"}}}, "zero_optimization.zenflow.select_strategy"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                "zenflow": {"select_strategy": "step"}}},  # DeepSpeed's interval default: auto
         "zero_optimization.zenflow.select_interval"),
        ({"gradient_clipings": 1.0}, "gradient_clipings"),
        ({"optimizer": {"type": "SGD"}}, "optimizer.type"),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale"),
    ],
)
def test_deepspeed_unsupported_keys_are_named(ds: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_deepspeed(ds)
    assert info.value.key == key


def test_local_data_file_template_is_sniffed_and_missing_file_named(tmp_path: Path) -> None:
    text = tmp_path / "notes.jsonl"
    text.write_text('{"text": "hello"}\n')
    plan = resolve_plan("tiny-llama", str(text))
    assert (plan.data.source, plan.data.template, plan.data.path) == ("local", "text", str(text.resolve()))
    with pytest.raises(ConfigError) as info:
        resolve_plan("tiny-llama", str(tmp_path / "nope.csv"))
    assert info.value.key == "--data"
    with pytest.raises(ConfigError) as info:
        resolve_plan(
            "tiny-llama",
            "alpaca-sample",
            overrides=["data.source=local", f"data.path={tmp_path / 'gone.jsonl'}"],
        )
    assert info.value.key == "data.path"


def test_model_argument_forms(tmp_path: Path) -> None:
    hub = resolve_plan("org/some-model", "alpaca-sample")
    assert (hub.model.source, hub.model.hub_id, hub.model.tokenizer) == (
        "hub",
        "org/some-model",
        "org/some-model",
    )
    (tmp_path / "config.json").write_text("{}")
    local = resolve_plan(str(tmp_path), "alpaca-sample")
    assert (local.model.source, local.model.hub_id) == ("local", str(tmp_path.resolve()))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_plan(str(empty), "alpaca-sample")
    with pytest.raises(UserError, match="did you mean llama2-7b"):
        resolve_plan("llama2-7", "alpaca")


def test_memory_estimate_llama2_7b_numbers() -> None:
    plan = resolve_plan("llama2-7b", "alpaca")
    small = estimate(plan, Machine(host_ram=24 * GB, cuda=False))
    p = 6.738e9
    p1 = (2 * 32 + 1) * 4096
    h = p - p1  # every 2-D weight has host columns
    assert small.item("fp32 master") == pytest.approx(4 * h) and small.item("fp32 moments") == pytest.approx(8 * h)
    # 24 GB hold no layout: the plan takes the leanest host one, the fp32 carry (layouts.py), and
    # no line for a checkpoint inside an interval (the save streams its sum)
    assert small.grad_layout == "carry" and small.item("gradient carry") == pytest.approx(4 * h)
    assert small.item("gradient slots") == 0 and small.host_accumulators == 1
    assert small.item("checkpoint interval sum") == 0 and small.resume_carry == 0
    assert small.item("weights") == pytest.approx(2 * p)  # bf16: 13.5 GB
    # master, moments and gradient buffer of the selected columns (k = floor(0.1 cols) per matrix)
    assert small.item("selected optimizer state") == pytest.approx(16 * (0.1 * h + p1), rel=0.01)
    assert not small.fits and "host RAM" in small.reasons[0]
    big = estimate(plan, Machine(host_ram=512 * GB, cuda=True, gpu_name="H100", gpu_mem=80 * GB))
    assert big.fits and big.device_kind == "cuda" and big.reasons == []
    # 512 GB hold two sets of 4 bf16 slots: the fastest layout, the sum stays on the host
    assert big.accumulate == "host" and big.grad_layout == "slots" and big.host_accumulators == 2
    assert big.item("gradient slots") == pytest.approx(2 * 4 * 2 * h) and big.item("gradient accumulator") == 0
    assert big.resume_carry == pytest.approx(4 * h)  # a resume inside an interval: transient, a note
    # topk_ratio 1: the whole optimizer on the device, nothing on the host but the process itself
    off = estimate(
        resolve_plan("llama2-7b", "alpaca", zenflow="off"), Machine(512 * GB, True, "H100", 80 * GB)
    )
    assert off.host_total == off.item("process baseline") == 2 * GB
    assert off.item("selected optimizer state") == pytest.approx(16 * p, rel=1e-3)
    assert not off.fits and "device memory" in off.reasons[0]


def test_llama_param_count_matches_transformers() -> None:
    cfg = resolve_plan("tiny-llama", "alpaca-sample").model.config
    fast, built = _llama_size(cfg), _built_size(cfg)
    assert (fast.params, fast.params_2d) == (built.params, built.params_2d) == (5_261_568, 5_259_264)


def test_default_plan_is_valid() -> None:
    assert plan_from_dict({"model": {"config": {"model_type": "llama"}}}).train == RunPlan().train
