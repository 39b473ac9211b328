"""Every shipped preset loads, validates and combines; presets ship inside the wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml

from zfctl.offload.config import ZenFlowConfig
from zfctl.plan import plan_from_dict, resolve_plan
from zfctl.plan.coerce import section_from_dict
from zfctl.plan.io import read_mapping
from zfctl.plan.legacy import upgrade_zenflow
from zfctl.plan.memory import Machine, estimate
from zfctl.plan.presets import KINDS, list_presets
from zfctl.plan.schema import RunPlan

ROOT = Path(__file__).resolve().parents[2]
ALL = [p for kind in KINDS for p in list_presets(kind)]
EXPECTED = {
    "model": {"llama2-7b", "llama2-13b", "llama2-70b", "llama3.2-1b", "opt-350m", "gpt2", "tiny-llama", "smollm2-135m"},
    "data": {"alpaca", "glue-sst2", "arxiv-abstract", "alpaca-sample", "sst2-sample", "chat-sample", "ultrachat"},
    "zenflow": {"default", "paper", "aggressive", "zero-offload", "off"},
}


# What each zenflow preset resolved to before the defaults became the `default` preset's (zfctl
# 0.x with the flat zenflow.* keys), in that version's spelling: whatever the model and data, a
# preset must still resolve to exactly these values, read through the mapping of old keys.
_PAPER_OLD = {"select_strategy": "auto", "select_interval": "auto", "full_warm_up_rounds": 0,
              "deferred_lr_scale": "off", "vocab_select": "columns"}
_MACHINERY_OLD = {"install_lag": 0, "stream_grads": True, "accumulate": "auto", "pin_memory": True,
                  "auto_ratio": 0.99, "auto_min_interval": 1, "auto_max_interval": 16, "cpu_threads": 0,
                  "accumulate_threads": 0, "ring_slots": 4, "ring_slot_mb": 32.0, "inflight_mb": 0.0}
BEFORE = {
    "default": {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 8, "update_interval": 4,
                "full_warm_up_rounds": 20, "overlap_step": True, "deferred_lr_scale": "repeat",
                "vocab_select": "rows", **_MACHINERY_OLD},
    "paper": {**_PAPER_OLD, "topk_ratio": 0.1, "update_interval": 4, "overlap_step": True, **_MACHINERY_OLD},
    "aggressive": {**_PAPER_OLD, "topk_ratio": 0.05, "update_interval": 8, "overlap_step": True, **_MACHINERY_OLD},
    # one deliberate change since: accumulate host (auto put a device sum on a GPU with room,
    # which plain ZeRO-Offload, the bench's yardstick, never has)
    "zero-offload": {**_PAPER_OLD, "topk_ratio": 0.0, "update_interval": 1, "overlap_step": False,
                     **_MACHINERY_OLD, "accumulate": "host"},
    "off": {**_PAPER_OLD, "topk_ratio": 1.0, "update_interval": 4, "overlap_step": False, **_MACHINERY_OLD},
}


def _before(name: str) -> ZenFlowConfig:
    return section_from_dict(ZenFlowConfig, upgrade_zenflow(BEFORE[name]), "zenflow")


def test_the_catalogue_is_complete() -> None:
    assert {kind: {p.name for p in list_presets(kind)} for kind in KINDS} == EXPECTED


@pytest.mark.parametrize("preset", ALL, ids=[f"{p.kind}/{p.name}" for p in ALL])
def test_preset_file_is_documented_and_validates_alone(preset) -> None:
    text = preset.path.read_text()
    first = text.splitlines()[0]
    assert first.startswith("# zfctl finetune "), first  # opens with the command that runs it
    assert "Memory" in text.split("\ndescription:")[0]  # and the memory it needs
    assert 10 < len(preset.description) <= 100
    fragment = preset.load()
    assert preset.kind in fragment
    base = {} if preset.kind == "model" else {"model": {"config": {"model_type": "llama"}}}
    plan = plan_from_dict({**base, **fragment})
    assert isinstance(plan, RunPlan)


@pytest.mark.parametrize("model", sorted(EXPECTED["model"]))
def test_every_model_data_zenflow_combination_resolves(model: str) -> None:
    for data in sorted(EXPECTED["data"]):
        for zenflow in sorted(EXPECTED["zenflow"]):
            plan = resolve_plan(model, data, zenflow=zenflow)
            assert (plan.model.name, plan.data.name) == (model, data)
            assert plan.zenflow == _before(zenflow), (model, data, zenflow)  # today's values, new spelling
    est = estimate(
        resolve_plan(model, "alpaca"), Machine(host_ram=1e12, cuda=True, gpu_name="x", gpu_mem=1e12)
    )
    assert est.size is not None and est.device_total > 0 and est.host_total > 0


def test_tiny_llama_matches_the_contract() -> None:
    plan = resolve_plan("tiny-llama", "alpaca-sample")
    assert plan.model.source == "config" and plan.model.tokenizer == "embedded"
    assert plan.train.precision == "fp32"
    want = {
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    }
    assert {k: plan.model.config[k] for k in want} == want
    assert plan.model.config["architectures"] == ["LlamaForCausalLM"]


def test_zenflow_presets_mean_what_they_say() -> None:
    z = {
        name: resolve_plan("tiny-llama", "alpaca-sample", zenflow=name).zenflow
        for name in EXPECTED["zenflow"]
    }
    d = z["default"]
    assert d == ZenFlowConfig()  # the library's defaults are the default preset
    assert (d.topk_ratio, d.update_interval, d.overlap_step, d.select_interval) == (0.1, 4, True, 8)
    assert (d.full_warm_up_rounds, d.deferred_lr_scale, d.vocab_select, d.tuning.install_lag) == (
        20, "repeat", "rows", 0)
    # paper: the same split, selected once per epoch, no warm-up, uncorrected CPU step
    p = z["paper"]
    assert (p.topk_ratio, p.update_interval, p.overlap_step, p.select_interval) == (0.1, 4, True, "auto")
    assert (p.full_warm_up_rounds, p.deferred_lr_scale, p.vocab_select, p.tuning.install_lag) == (
        0, "off", "columns", 0)
    zo = z["zero-offload"]
    assert (zo.topk_ratio, zo.update_interval, zo.overlap_step) == (0.0, 1, False)
    assert z["off"].topk_ratio == 1.0
    assert z["aggressive"].topk_ratio < d.topk_ratio and z["aggressive"].update_interval > d.update_interval


@pytest.mark.parametrize("name", ["alpaca-sample", "sst2-sample", "chat-sample"])
def test_sample_presets_point_at_shipped_files(name: str) -> None:
    plan = resolve_plan("tiny-llama", name)
    folder = ROOT / "presets" / "samples" / plan.data.path
    assert plan.data.source == "sample" and plan.data.validation_split == "validation"
    assert (folder / "train.jsonl").is_file() and (folder / "validation.jsonl").is_file()
    first = yaml.safe_load((folder / "train.jsonl").read_text().splitlines()[0])
    fields = {"alpaca-sample": {"instruction", "input", "output"}, "sst2-sample": {"sentence", "label"},
              "chat-sample": {"messages"}}[name]
    assert fields <= set(first)


def test_hub_data_presets_name_their_datasets() -> None:
    assert resolve_plan("gpt2", "alpaca").data.path == "tatsu-lab/alpaca"
    assert resolve_plan("gpt2", "arxiv-abstract").data.path == "ash001/arxiv-abstract"
    chat = resolve_plan("gpt2", "ultrachat").data
    assert (chat.path, chat.split, chat.validation_split, chat.template) == (
        "HuggingFaceH4/ultrachat_200k", "train_sft", "test_sft", "chat")
    sst2 = resolve_plan("gpt2", "glue-sst2").data
    assert (sst2.subset, sst2.template, sst2.text_field, sst2.label_names) == (
        "sst2",
        "classification",
        "sentence",
        ["negative", "positive"],
    )


def test_pyproject_lists_every_zfctl_package() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "zfctl").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject [tool.setuptools] packages: {sorted(found - listed)}"


@pytest.mark.slow
def test_wheel_ships_presets_and_native_and_finds_them(tmp_path: Path) -> None:
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("zfctl-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    shipped = {str(p.relative_to(ROOT / "presets")) for p in (ROOT / "presets").rglob("*") if p.is_file()}
    packaged = {
        str(p.relative_to(site / "zfctl" / "presets"))
        for p in (site / "zfctl" / "presets").rglob("*")
        if p.is_file()
    }
    assert shipped <= packaged
    # the installed layout: no checkout next to the package, presets_root() finds zfctl/presets
    code = (
        "from zfctl.resources import presets_root; from zfctl.plan.presets import list_presets; "
        "import zfctl._native as n; "
        "print(presets_root()); print(len(list_presets('model'))); "
        f"print(n.__file__.startswith({str(site)!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    # the wheel also carries the compiled CPU-Adam (setup.py's cffi_modules), and it imports
    assert list((site / "zfctl").glob("_zfnative*.so")), "the wheel has no native extension"
    assert out.stdout.split() == [str(site / "zfctl" / "presets"), str(len(EXPECTED["model"])), "True"]
    assert (
        read_mapping(site / "zfctl" / "presets" / "models" / "tiny-llama.yaml")["model"]["source"] == "config"
    )
