"""Small features the other tools have: `zfctl generate --prompts FILE` (JSON lines out),
`--system TEXT` for chat runs, and `train.sample_prompts`, answered and logged at each evaluation.

Tiny 2-layer runs in-process (a few steps each); answers are compared with the one-prompt path
(greedy: the same tokens), never with fixed strings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import widen_consoles
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import UserError
from zfctl.plan.resolve import resolve_plan
from zfctl.train import run
from zfctl.train.generate import load_generator
from zfctl.train.metrics import read_metrics
from zfctl.train.prompts import read_prompts
from zfctl.train.samples import SAMPLE_TOKENS

runner = CliRunner()
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4", "data.end_idx=64",
    "data.max_length=64", "train.micro_batch_size=4", "train.eval_batches=2", "train.device=cpu",
    "train.precision=fp32", "zenflow.full_warm_up_rounds=0", "logging.every=1",
]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch, 400)


def zf(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def tiny(out: Path, data: str, *extra: str):
    return run(resolve_plan("tiny-llama", data, overrides=[*TINY, f"checkpoint.output_dir={out}", *extra]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gen")
    tiny(root / "alpaca", "alpaca-sample", "train.max_steps=2", "train.eval_every=0")
    tiny(root / "chat", "chat-sample", "train.max_steps=2", "train.eval_every=0")
    return {"alpaca": root / "alpaca", "chat": root / "chat"}


def test_prompts_from_a_file_answer_as_one_prompt_does_as_json_lines(runs, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 12 + 7?\n\nSay hi.\n", encoding="utf-8")
    result = zf("generate", runs["alpaca"], "--prompts", prompts, "--max-new-tokens", "6")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]  # stdout holds JSON lines only
    assert [r["prompt"] for r in rows] == ["What is 12 + 7?", "Say hi."]
    gen = load_generator(runs["alpaca"], torch.device("cpu"), [])
    for r in rows:
        assert r["answer"] == gen.answer(r["prompt"], max_new_tokens=6, temperature=0.0)
    assert result.stderr.startswith("model: "), result.stderr


def test_a_chat_run_takes_a_system_turn_and_other_runs_refuse_it(runs, tmp_path):
    gen = load_generator(runs["chat"], torch.device("cpu"), [])
    with_system = gen.prompt_ids(gen.messages("Hi", "Answer in French."))
    assert with_system != gen.prompt_ids(gen.messages("Hi"))
    assert gen.tokenizer.decode(with_system).find("Answer in French.") >= 0  # rendered by the run's template
    lines = tmp_path / "p.jsonl"
    lines.write_text('"Hi"\n{"prompt": "Hello", "system": "Be brief."}\n', encoding="utf-8")
    result = zf("generate", runs["chat"], "--prompts", lines, "--system", "Answer in French.",
                "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["prompt"], r["system"]) for r in rows] == [("Hi", "Answer in French."), ("Hello", "Be brief.")]
    assert rows[1]["answer"] == gen.answer("Hello", system="Be brief.", max_new_tokens=4, temperature=0.0)
    # an alpaca run's format has no system turn: one line before any model is loaded
    result = zf("generate", runs["alpaca"], "--prompt", "Hi", "--system", "Be brief.")
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: --system: ") and "data.template=alpaca" in line, line


@pytest.mark.parametrize("text, needle", [
    ('"ok"\n{"prompt": null}\n', 'line 2: "prompt" is null'),
    ('"ok"\n\n{not json\n', "line 3 is not valid JSON"),
    ('{"prompt": "a", "temperature": 1}\n', "line 1: unknown key 'temperature'"),
    ("\n  \n", "holds no prompt"),
])
def test_a_bad_prompts_file_is_one_line_naming_its_line(runs, tmp_path, text: str, needle: str):
    f = tmp_path / "p.jsonl"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(UserError, match=needle.replace("(", r"\(")):
        read_prompts(f)
    result = zf("generate", runs["alpaca"], "--prompts", f)
    assert result.exit_code == 2 and needle in result.stderr and result.stdout == "", result.output
    assert zf("generate", runs["alpaca"], "--prompts", f, "--prompt", "x").exit_code == 2  # one of the three


@pytest.mark.slow
def test_sample_prompts_are_answered_at_each_evaluation_without_touching_the_losses(tmp_path):
    """Greedy answers draw nothing from any RNG: the losses are bit-identical to a run without
    them. Each evaluation (step 0, every 2 steps, the end) logs one record per prompt, answered
    by the model as it was then (the same answer as generating from that step's weights)."""
    # overlap off: no CPU update is in flight at a checkpoint, so the live model at step 2 is what
    # `zfctl generate` loads from that checkpoint
    common = ("train.max_steps=4", "train.eval_every=2", "checkpoint.every=2", "checkpoint.keep_last=3",
              "zenflow.overlap_step=false")
    tiny(tmp_path / "plain", "alpaca-sample", *common)
    tiny(tmp_path / "sampled", "alpaca-sample", *common, "train.sample_prompts=['What is 12 + 7?', 'Say hi.']")
    plain = read_metrics(tmp_path / "plain" / "metrics.jsonl", "train")
    sampled = read_metrics(tmp_path / "sampled" / "metrics.jsonl", "train")
    assert [r["loss"] for r in plain] == [r["loss"] for r in sampled]
    samples = read_metrics(tmp_path / "sampled" / "metrics.jsonl", "sample")
    prompts = ["What is 12 + 7?", "Say hi."]
    # step 0 (the baseline), 2, and the end (after the in-flight CPU update is installed: the final weights)
    assert [(r["step"], r["prompt"]) for r in samples] == [(s, p) for s in (0, 2, 4) for p in prompts]
    for step in (2, 4):
        gen = load_generator(tmp_path / "sampled" / "checkpoints" / f"step-{step:06d}", torch.device("cpu"), [])
        assert [r["answer"] for r in samples if r["step"] == step] == [
            gen.answer(p, max_new_tokens=SAMPLE_TOKENS, temperature=0.0) for p in prompts]
    assert any(r["answer"] for r in samples if r["step"] == 2)  # a real comparison, not of two empty answers


def test_sample_answers_draw_nothing_from_any_rng_and_leave_the_model_as_it_was() -> None:
    """What keeps a run with train.sample_prompts bit-identical to one without, on a model with
    dropout too: greedy decoding leaves the torch RNG where it was, and the model in train mode."""
    from zfctl.train.models.load import load_model
    from zfctl.train.samples import SamplePrompts

    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[*TINY, "train.sample_prompts=['What is 12 + 7?']",
                                                                  "model.config.attention_dropout=0.1"])
    model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=0).train()
    samples = SamplePrompts(plan, model_config=model.config)
    before = torch.get_rng_state()
    [answer] = samples.answers(model, torch.device("cpu"), lockstep=False)
    assert torch.equal(torch.get_rng_state(), before) and model.training
    assert answer == load_generator_like(model, plan).answer("What is 12 + 7?", max_new_tokens=SAMPLE_TOKENS,
                                                             temperature=0.0)


def load_generator_like(model, plan):
    """A Generator over ``model`` in ``plan``'s prompt format (what `zfctl generate` builds)."""
    from zfctl.train.data.prompt_format import prompt_template
    from zfctl.train.generate import Generator
    from zfctl.train.models.load import load_tokenizer

    tok = load_tokenizer(plan.model)
    tok.chat_template = prompt_template(plan.data, tok)
    return Generator(model.eval(), tok, "live", multi_turn=False)


def test_sample_prompts_are_checked_next_to_the_field() -> None:
    for bad, needle in ((["ok", ""], "train.sample_prompts[1]=''"), (["ok", 3], "train.sample_prompts[1]=3"),
                        ([f"p{i}" for i in range(17)], "give at most 16")):
        with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            resolve_plan("tiny-llama", "alpaca-sample", overrides=[f"train.sample_prompts={json.dumps(bad)}"])
