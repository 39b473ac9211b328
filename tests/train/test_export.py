"""Export round trip: what `from_pretrained` loads is exactly the model training finished with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from zfctl.errors import UserError
from zfctl.plan.resolve import resolve_plan
from zfctl.train import export, loss, run
from zfctl.train.data.prepare import prepare_data
from zfctl.train.models.load import load_tokenizer
from zfctl.train.recipe import FinetuneRecipe
from zfctl.train.tensorfile import load_state

TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=64", "data.max_length=64", "train.micro_batch_size=4", "train.eval_batches=2",
    "train.device=cpu", "train.precision=fp32", "train.lr=3e-3", "train.eval_every=0",
    # overlap on, and the run ends mid-interval: the last CPU update is still in flight at the
    # final checkpoint, so export must install it to match the trained model
    "zenflow.update_interval=4", "zenflow.overlap_step=true", "zenflow.topk_ratio=0.1",
    "zenflow.full_warm_up_rounds=0",  # these few steps are about the steady state, not the warm-up
    "train.max_steps=6", "checkpoint.every=0",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "run"
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[*TINY, f"checkpoint.output_dir={out}"])
    captured = []

    real_train = FinetuneRecipe.train

    def train_and_keep(recipe):
        result = real_train(recipe)
        captured.append(recipe.model)  # the live model, after the final flush
        return result

    mp = pytest.MonkeyPatch()
    mp.setattr(FinetuneRecipe, "train", train_and_keep)
    try:
        result = run(plan)
    finally:
        mp.undo()
    return plan, result, captured[0]


@pytest.mark.slow
def test_exported_logits_equal_trained_model(trained, tmp_path):
    plan, result, model = trained
    pending = load_state(result.last_checkpoint / "optimizer-rank00000.safetensors")
    assert pending["counters"]["pending_install"]  # the case export must get right: an update in flight
    folder = export(result.output_dir, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "zfctl-plan.yaml"} <= {p.name for p in folder.iterdir()}
    assert json.loads((folder / "zfctl-export.json").read_text())["step"] == 6
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("### Instruction:\nReverse the order of the words.", return_tensors="pt")["input_ids"]
    assert ids.equal(load_tokenizer(plan.model)(
        "### Instruction:\nReverse the order of the words.", return_tensors="pt")["input_ids"])
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    # and the exported model scores the eval set exactly as the run's final evaluation did
    prepared = prepare_data(plan.data, tok, seed=plan.train.seed)
    eval_loss = loss.evaluate(loaded, prepared.eval, prepared.collate, torch.device("cpu"),
                              micro_batch_size=plan.train.micro_batch_size, max_batches=plan.train.eval_batches)
    assert eval_loss == result.final_eval_loss


def test_export_refuses_existing_folder_and_offline_hub(trained, tmp_path, monkeypatch):
    _, result, _ = trained
    target = tmp_path / "hf"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists and is not empty; pass --force"):
        export(result.output_dir, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    fresh = tmp_path / "fresh"
    with pytest.raises(UserError, match="hub cannot be reached; export without --push-to-hub"):
        export(result.output_dir, fresh, push_to_hub="me/tiny")
    assert not fresh.exists()
    with pytest.raises(UserError, match="expected a repo id"):
        export(result.output_dir, fresh, push_to_hub="not a repo")
    # --force never replaces a folder export did not write...
    with pytest.raises(UserError, match="was not written by zfctl export"):
        export(result.output_dir, target, force=True)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    # ...and replaces an earlier export only once the new one is complete
    earlier = tmp_path / "earlier"
    export(result.output_dir, earlier)
    (earlier / "stale.txt").write_text("from the earlier export")
    export(result.output_dir, earlier, force=True)
    assert (earlier / "model.safetensors").is_file() and not (earlier / "stale.txt").exists()
    assert not [p for p in Path(tmp_path).iterdir() if p.name.startswith(".")]


def test_the_package_export_stays_the_function_after_its_module_is_imported():
    """zfctl.train.export is the library's function; the module that implements it has another
    name (hf_export), so importing it cannot replace the function with a module (the export
    module was once called export, and every export after its first import in one process
    called a module)."""
    import zfctl.train
    import zfctl.train.hf_export

    assert callable(zfctl.train.export) and zfctl.train.export.__module__ == "zfctl.train"
