"""Template chat: conversations rendered with the tokenizer's chat template, loss on the assistant's turns.

Every expected mask comes from transformers itself: the default template marks the assistant's
content and its end-of-turn token with a generation block, and ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` turns that into a token mask from character offsets. zfctl
computes its mask a different way (per-turn rendering, module docstring of
zfctl/train/data/chat.py), so the two agreeing token for token is the check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import UserError
from zfctl.plan.resolve import resolve_plan
from zfctl.plan.schema import DataConfig, ModelConfig
from zfctl.train.data.chat import chat_template, default_chat_template
from zfctl.train.data.prepare import format_debug_samples, prepare_data
from zfctl.train.models.load import load_tokenizer

IGNORE = -100
SYSTEM = "You answer in one short line."
TWO_TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "12 + 7 = 19."},
    {"role": "user", "content": "And if you double it?"},
    {"role": "assistant", "content": "Doubled, 19 is 38."},
]
ONE_TURN = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


def oracle(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, labels) as transformers masks them from the template's generation blocks."""
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = list(out["input_ids"])
    return ids, [t if m else IGNORE for t, m in zip(ids, out["assistant_masks"], strict=True)]


def runs(labels: list[int]) -> str:
    """'29×-100, 5×loss, ...': the label runs as --debug-data lists them."""
    out: list[list] = []
    for x in labels:
        kind = "-100" if x == IGNORE else "loss"
        if out and out[-1][1] == kind:
            out[-1][0] += 1
        else:
            out.append([1, kind])
    return ", ".join(f"{n}×{k}" for n, k in out)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def chat_data(path: Path, tok, cache: Path, **kw):
    cfg = DataConfig(name=str(path), source="local", path=str(path), template="chat", validation_fraction=0.0, **kw)
    return prepare_data(cfg, tok, seed=0, cache_dir=cache)


def trained_text(tok, ex: dict) -> list[str]:
    """The runs of labelled tokens, decoded."""
    runs, cur = [], []
    for t in ex["labels"] + [IGNORE]:
        if t != IGNORE:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


def test_embedded_tokenizer_ships_the_default_template(tok):
    assert tok.chat_template == default_chat_template() == chat_template(tok)
    assert tok.apply_chat_template(ONE_TURN, tokenize=False) == (
        "<s>user\nName a colour.</s>\n<s>assistant\nTeal.</s>\n")


def test_multi_turn_labels_are_every_assistant_turn_with_its_eos_and_nothing_else(tmp_path, tok):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": TWO_TURNS}, {"messages": ONE_TURN}])
    d = chat_data(f, tok, tmp_path / "c")
    for ex, messages in zip(d.train, (TWO_TURNS, ONE_TURN), strict=True):
        assert (ex["input_ids"], ex["labels"]) == oracle(tok, messages)
    assert trained_text(tok, d.train[0]) == ["12 + 7 = 19.</s>", "Doubled, 19 is 38.</s>"]
    assert trained_text(tok, d.train[1]) == ["Teal.</s>"]
    # the training text is the template's rendering, unchanged
    assert tok.decode(d.train[0]["input_ids"]) == tok.apply_chat_template(TWO_TURNS, tokenize=False)
    want = sum(x != IGNORE for m in (TWO_TURNS, ONE_TURN) for x in oracle(tok, m)[1])
    assert d.stats.loss_tokens == want


def test_a_system_turn_is_never_trained_wherever_it_stands(tmp_path, tok):
    middle = [*ONE_TURN, {"role": "system", "content": "Now answer in French."},
              {"role": "user", "content": "Name another."}, {"role": "assistant", "content": "Rouge."}]
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": TWO_TURNS}, {"messages": middle}])
    d = chat_data(f, tok, tmp_path / "c")
    for ex, messages in zip(d.train, (TWO_TURNS, middle), strict=True):
        ids, labels = oracle(tok, messages)
        assert (ex["input_ids"], ex["labels"]) == (ids, labels)
        for m in messages:
            if m["role"] == "system":  # its tokens are in the sequence, none in the loss
                span = tok(m["content"], add_special_tokens=False).input_ids
                at = next(i for i in range(len(ids)) if ids[i:i + len(span)] == span)
                assert ex["labels"][at:at + len(span) + 1] == [IGNORE] * (len(span) + 1)  # its </s> too
    assert trained_text(tok, d.train[1]) == ["Teal.</s>", "Rouge.</s>"]


def test_truncation_keeps_whole_turns_cuts_a_lone_answer_and_drops_what_has_no_answer(tmp_path, tok):
    first_len = len(oracle(tok, TWO_TURNS[:3])[0])
    long_answer = [{"role": "user", "content": "Count."},
                   {"role": "assistant", "content": " ".join(str(i) for i in range(40))}]
    no_room = [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in (TWO_TURNS, long_answer, no_room)])
    d = chat_data(f, tok, tmp_path / "c", max_length=first_len + 5)
    # the second exchange does not fit: the first is kept whole (its answer, </s> and newline)
    assert (d.train[0]["input_ids"], d.train[0]["labels"]) == oracle(tok, TWO_TURNS[:3])
    # a first answer longer than the room left is cut at max_length: trained up to there, no </s>
    ids, labels = oracle(tok, long_answer)
    assert len(ids) > first_len + 5
    assert (d.train[1]["input_ids"], d.train[1]["labels"]) == (ids[:first_len + 5], labels[:first_len + 5])
    assert d.train[1]["labels"][-1] not in (IGNORE, tok.eos_token_id)
    # the question alone fills max_length: no trained token would be left, so it is dropped and counted
    assert (len(d.train), d.stats.dropped) == (2, 1)
    assert "3 records" in d.summary() and "1 dropped (no trained token within max_length)" in d.summary()


def test_sharegpt_records_map_their_roles_and_train_like_messages(tmp_path, tok):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    share = [{"from": names[m["role"]], "value": m["content"]} for m in TWO_TURNS]
    f = write_jsonl(tmp_path / "s.jsonl", [{"conversations": share}, {"messages": TWO_TURNS}])
    d = chat_data(f, tok, tmp_path / "c")
    assert (d.train[0]["input_ids"], d.train[0]["labels"]) == oracle(tok, TWO_TURNS)
    assert d.train[0] == d.train[1]


GOOD = {"messages": ONE_TURN}


@pytest.mark.parametrize(
    "bad,field,problem",
    [
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hey"}]},
         "messages[1].role", "is 'bot': use system, user, assistant"),
        ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "assistant", "value": "Hey"}]},
         "conversations[1].from", "is 'assistant': use system, human, gpt"),
        ({"messages": []}, "messages", "is empty"),
        ({"conversations": [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hi"}]},
         "conversations", "has no gpt turn"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "messages", "has no assistant turn"),
        ({"messages": [{"role": "assistant", "content": "Hey"}, {"role": "user", "content": "Hi"}]},
         "messages[0].role", "is 'assistant': the conversation opens with an answer"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 3}]},
         "messages[1].content", "must be a string, got int"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}]},
         "messages[1].content", "is empty"),
        ({"messages": "Hi"}, "messages", "must be a list of turns"),
        ({"text": "Hi"}, "messages", "is missing (the record has 'text')"),
    ],
)
def test_bad_chat_record_is_named_by_file_index_and_field(tmp_path, tok, bad, field, problem):
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD, {"messages": TWO_TURNS}])
    d = chat_data(good, tok, tmp_path / "c")  # the same file without the bad record trains exactly
    assert [(ex["input_ids"], ex["labels"]) for ex in d.train] == [oracle(tok, ONE_TURN), oracle(tok, TWO_TURNS)]
    f = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, GOOD, bad, GOOD])
    with pytest.raises(UserError) as e:
        chat_data(f, tok, tmp_path / "c")
    assert str(e.value).startswith(f"{f}: record 4: field {field!r} {problem}"), str(e.value)  # from 1
    assert "\n" not in str(e.value)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # Renders only the last turn's text in full: adding a turn changes the earlier text.
    tok = load_tokenizer(ModelConfig())
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% else %}{{ m['role'] }}"
                         "{% endif %}{{ eos_token }}{% endfor %}")
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": TWO_TURNS}])
    with pytest.raises(UserError, match=r"record 1: field 'messages\[2\]' renders differently once later turns"):
        chat_data(f, tok, tmp_path / "c")


def test_cache_key_holds_the_template_and_the_chat_template(tmp_path, tok):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": TWO_TURNS, "text": "plain words"}])
    cache = tmp_path / "c"
    first = chat_data(f, tok, cache)
    assert chat_data(f, tok, cache).stats.from_cache
    as_text = prepare_data(DataConfig(name=str(f), source="local", path=str(f), template="text",
                                      validation_fraction=0.0), tok, seed=0, cache_dir=cache)
    assert not as_text.stats.from_cache and as_text.cache_path != first.cache_path
    other = load_tokenizer(ModelConfig())
    other.chat_template = default_chat_template().replace("{{- '\\n' -}}", "{{- '\\n\\n' -}}")  # turns apart
    changed = chat_data(f, other, cache)
    assert not changed.stats.from_cache and changed.cache_path != first.cache_path
    assert changed.train[0]["input_ids"] != first.train[0]["input_ids"]
    assert (changed.train[0]["input_ids"], changed.train[0]["labels"]) == oracle(other, TWO_TURNS)


def test_a_tokenizer_without_a_template_gets_the_default(tmp_path, tok):
    bare = load_tokenizer(ModelConfig())
    bare.chat_template = None
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": TWO_TURNS}])
    ex = chat_data(f, bare, tmp_path / "c").train[0]
    assert (ex["input_ids"], ex["labels"]) == oracle(tok, TWO_TURNS)


runner = CliRunner()


def test_cli_guesses_chat_checks_the_first_record_and_debug_data_marks_the_answers(tmp_path):
    f = write_jsonl(tmp_path / "chats.jsonl", [{"messages": TWO_TURNS}] * 8)
    plan = resolve_plan("tiny-llama", str(f), notes=(notes := []))
    assert plan.data.template == "chat" and any(n.startswith("data.template=chat: guessed") for n in notes)
    env = {"COLUMNS": "200", "ZFCTL_CACHE_DIR": str(tmp_path / "cache")}
    res = runner.invoke(app, ["finetune", "tiny-llama", "--data", str(f), "--debug-data"], env=env)
    assert res.exit_code == 0, res.output
    assert "note: data.template=chat: guessed from the fields of the first record of chats.jsonl" in res.output
    ids, labels = oracle(load_tokenizer(ModelConfig()), TWO_TURNS)
    in_loss = sum(x != IGNORE for x in labels)
    assert f"--- train[0]: {len(ids)} tokens, {in_loss} in the loss (labels: {runs(labels)})" in res.output
    assert "<s>assistant\n⟦12 + 7 = 19.</s>⟧\n<s>user\nAnd if you double it?</s>\n<s>assistant\n⟦Doubled" in res.output
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "human", "value": "Hi"},
                                                                  {"from": "bot", "value": "Hey"}]}])
    res = runner.invoke(app, ["finetune", "tiny-llama", "--data", str(bad), "--output", str(tmp_path / "r")], env=env)
    assert res.exit_code == 2
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: {bad}: record 1: field 'conversations[1].from' is 'bot': use system, human, gpt"]
    assert "zenflow" not in res.output  # refused before the plan is printed
    assert not (tmp_path / "r").exists()


def test_debug_samples_show_a_conversation(tmp_path, tok):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": TWO_TURNS}])
    shown = format_debug_samples(chat_data(f, tok, tmp_path / "c"), tok, n=1)
    assert f"<s>system\n{SYSTEM}</s>\n<s>user\nWhat is 12 + 7?</s>\n<s>assistant\n⟦12 + 7 = 19.</s>⟧\n" in shown


def test_the_chat_hub_preset_fails_offline_with_one_line(monkeypatch, tmp_path, tok):
    from zfctl.errors import ConfigError
    from zfctl.train.models import hub as model_hub

    monkeypatch.setattr(model_hub, "_probe_result", {})
    monkeypatch.setattr(model_hub, "hub_endpoint", lambda: "https://hub.invalid")
    plan = resolve_plan("tiny-llama", "ultrachat")
    with pytest.raises(ConfigError) as e:
        prepare_data(plan.data, tok, seed=0, cache_dir=tmp_path)
    assert str(e.value).startswith("data.path='HuggingFaceH4/ultrachat_200k': the Hugging Face hub "
                                   "(https://hub.invalid) cannot be reached; use the shipped samples "
                                   "(alpaca-sample, sst2-sample, chat-sample)")
