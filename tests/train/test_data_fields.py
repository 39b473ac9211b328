"""Records whose fields have other names: data.fields, and the prompt/completion template.

A prompt/completion file (TRL's and OpenAI's format) trains with the prompt as written and the
loss on the completion; its template is guessed with a note. ``data.fields`` maps the alpaca and
prompt_completion fields to the record's own names; a missing field's error names that mapping.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_data_pipeline import write_jsonl
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import ConfigError, UserError
from zfctl.plan.resolve import resolve_plan
from zfctl.plan.schema import DataConfig, ModelConfig
from zfctl.plan.validate import check_data
from zfctl.train.data.prepare import prepare_data
from zfctl.train.models.load import load_tokenizer

IGNORE = -100
runner = CliRunner()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


def local(path: Path, **kw) -> DataConfig:
    return DataConfig(name=str(path), source="local", path=str(path), validation_fraction=0.0, **kw)


def test_prompt_completion_trains_on_the_completion_only(tmp_path, tok):
    f = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: 2 plus 2?\nA:", "completion": " 4"}])
    ex = prepare_data(local(f, template="prompt_completion"), tok, seed=0, cache_dir=tmp_path / "c").train[0]
    prompt = tok("Q: 2 plus 2?\nA:", add_special_tokens=False).input_ids
    answer = tok(" 4", add_special_tokens=False).input_ids
    assert ex["input_ids"] == [tok.bos_token_id, *prompt, *answer, tok.eos_token_id]
    assert ex["labels"] == [IGNORE] * (1 + len(prompt)) + answer + [tok.eos_token_id]


def test_fields_map_alpaca_and_prompt_completion_to_the_records_names(tmp_path, tok):
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Say hi.", "answer": "hi"}])
    mapped = prepare_data(local(qa, fields={"instruction": "question", "output": "answer"}), tok, seed=0,
                          cache_dir=tmp_path / "c").train[0]
    same = write_jsonl(tmp_path / "same.jsonl", [{"instruction": "Say hi.", "output": "hi"}])
    plain = prepare_data(local(same), tok, seed=0, cache_dir=tmp_path / "c").train[0]
    assert mapped == plain
    mapped = prepare_data(local(qa, template="prompt_completion", fields={"prompt": "question", "completion": "answer"}),
                          tok, seed=0, cache_dir=tmp_path / "c").train[0]
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Say hi.", "completion": "hi"}])
    assert mapped == prepare_data(local(pc, template="prompt_completion"), tok, seed=0,
                                  cache_dir=tmp_path / "c").train[0]


def test_a_missing_field_names_the_mapping_that_fixes_it(tmp_path, tok):
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Say hi.", "answer": "hi"}])
    with pytest.raises(UserError, match=r"field 'instruction' is missing \(the record has 'question', 'answer'\); "
                                        r"if another field holds it, --set data.fields.instruction=THAT_FIELD"):
        prepare_data(local(qa), tok, seed=0, cache_dir=tmp_path / "c")
    with pytest.raises(UserError, match=r"field 'answer ' is missing.*--set data.fields.output=THAT_FIELD"):
        prepare_data(local(qa, fields={"instruction": "question", "output": "answer "}), tok, seed=0,
                     cache_dir=tmp_path / "c")


@pytest.mark.parametrize(("template", "fields", "message"), [
    ("alpaca", {"question": "q"}, r"data.fields.question='q': template alpaca reads instruction, input, output"),
    ("alpaca", {"instruction": ""}, r"data.fields.instruction='': must name the record's field"),
    ("text", {"text": "body"}, r"data.fields=.*template text reads no mapped fields.*data.text_field"),
    ("chat", {"messages": "turns"}, r"template chat reads no mapped fields.*'messages' or 'conversations'"),
])
def test_bad_fields_are_one_line_naming_the_key(template, fields, message):
    with pytest.raises(ConfigError, match=message):
        check_data(DataConfig(template=template, fields=fields))


def test_prompt_completion_files_are_guessed_with_a_note(tmp_path):
    f = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    notes: list[str] = []
    plan = resolve_plan("tiny-llama", str(f), notes=notes)
    assert plan.data.template == "prompt_completion"
    assert [n for n in notes if "guessed" in n] == [
        ("data.template=prompt_completion: guessed from the fields of the first record of pc.jsonl; "
         "--set data.template=... to choose another")]


def test_cli_trains_a_prompt_completion_file_and_a_mapped_file(tmp_path):
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"Q: {i} plus 1?\nA:", "completion": f" {i + 1}"}
                                             for i in range(40)])
    res = runner.invoke(app, ["finetune", "tiny-llama", "--data", str(pc), "--debug-data"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "data.template=prompt_completion: guessed" in res.output
    assert "<s>Q: 0 plus 1?\nA:⟦ 1</s>⟧" in res.output
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(40)])
    res = runner.invoke(app, ["finetune", "tiny-llama", "--data", str(qa), "--debug-data",
                              "--set", "data.fields={instruction: question, output: answer}"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "<s>### Instruction:\nq0\n\n### Response:\n⟦a0</s>⟧" in res.output
