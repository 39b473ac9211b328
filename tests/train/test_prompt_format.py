"""The prompt format as a chat template: apply_chat_template builds the ids training saw.

For every template, the generation prompt rendered by ``prompt_template`` (what ``zfctl export``
writes as ``chat_template`` and what ``zfctl generate`` renders with) tokenises to exactly the
ids in front of the first trained token of the prepared sequence, and the whole exchange renders
the text of the whole sequence.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zfctl.plan.schema import DataConfig, ModelConfig
from zfctl.train.data.prepare import prepare_data
from zfctl.train.data.prompt_format import prompt_template
from zfctl.train.models.load import load_tokenizer

IGNORE = -100


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


def _prepared(tmp_path: Path, tok, rows: list[dict], **cfg):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    data = DataConfig(name="d", source="local", path=str(path), validation_fraction=0.0, **cfg)
    return data, prepare_data(data, tok, seed=0, cache_dir=tmp_path / "cache")


CASES = {
    "alpaca": ([{"instruction": "What is 12 + 7?", "output": "19"},
                {"instruction": "Reverse the words.", "output": "c b a"}], {}, "instruction", "output"),
    "prompt_completion": ([{"prompt": "Q: 2 plus 2?\nA:", "completion": " 4"},
                           {"prompt": "Translate to French: cat", "completion": "chat"}], {}, "prompt", "completion"),
    "classification": ([{"text": "A warm, funny film.", "label": 1}, {"text": "Dull.", "label": 0}],
                       {"label_names": ["negative", "positive"]}, "text", None),
    "text": ([{"text": "Once upon a time there was a kettle."}], {}, "text", None),
}


@pytest.mark.parametrize("template", sorted(CASES))
def test_rendered_prompt_tokenises_to_the_trained_prefix(tmp_path, tok, template):
    rows, extra, prompt_field, answer_field = CASES[template]
    data, prepared = _prepared(tmp_path, tok, rows, template=template, **extra)
    tok.chat_template = prompt_template(data, tok)
    for ex, row in zip(prepared.train, rows, strict=True):
        first = next(i for i, x in enumerate(ex["labels"]) if x != IGNORE)
        user = [{"role": "user", "content": row[prompt_field]}]
        ids = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
        if template == "text":  # no prompt: the document is the user's text, the model continues it
            assert list(ids) == ex["input_ids"][:-1] and first == 1
            continue
        assert list(ids) == ex["input_ids"][:first]
        answer = row[answer_field] if answer_field else extra["label_names"][row["label"]]
        whole = tok.apply_chat_template([*user, {"role": "assistant", "content": answer}], tokenize=False)
        # the same text; its ids may differ where the tokenizer merges across the prompt/answer
        # boundary (": 4"), which training never does: it tokenises the two apart, as generation does
        assert whole == tok.decode(ex["input_ids"])


def test_alpaca_template_is_not_the_tokenizers_chatml(tok):
    """The export of an alpaca run must not ship the tokenizer's own (ChatML-like) template."""
    own = tok.chat_template
    text = prompt_template(DataConfig(template="alpaca"), tok)
    assert text != own and "### Instruction:" in text and "### Response:" in text
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                       tokenize=False, chat_template=text)
    assert rendered == "<s>### Instruction:\nHi\n\n### Response:\n"


def test_chat_runs_keep_the_template_they_rendered_with(tok):
    from zfctl.train.data.chat import chat_template

    assert prompt_template(DataConfig(template="chat"), tok) == chat_template(tok)
