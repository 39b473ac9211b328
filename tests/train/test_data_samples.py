"""The shipped samples and the embedded tokenizer: reproducible from their scripts, and sound."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "presets" / "samples"
EMBEDDED = REPO / "presets" / "tokenizers" / "embedded"


def _script(name: str):
    """Import scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize(
    "script,sample",
    [("gen_alpaca_sample", "alpaca-sample"), ("gen_sst2_sample", "sst2-sample"), ("gen_chat_sample", "chat-sample")],
)
def test_generators_are_deterministic_and_match_shipped_files(tmp_path, script, sample):
    mod = _script(script)
    mod.main(["--out", str(tmp_path / "a")])
    mod.main(["--out", str(tmp_path / "b")])
    for split in ("train.jsonl", "validation.jsonl"):
        first = (tmp_path / "a" / split).read_bytes()
        assert first == (tmp_path / "b" / split).read_bytes()
        # The committed files are exactly what the script writes: nobody edited them by hand.
        assert first == (SAMPLES / sample / split).read_bytes(), f"re-run scripts/{script}.py"


def test_alpaca_sample_shape_and_held_out_split():
    train, val = (
        _rows(SAMPLES / "alpaca-sample" / "train.jsonl"),
        _rows(SAMPLES / "alpaca-sample" / "validation.jsonl"),
    )
    assert (len(train), len(val)) == (1880, 120)
    for r in train + val:
        assert list(r) == ["instruction", "input", "output"]
        assert r["instruction"] and r["output"] and isinstance(r["input"], str)
    keys = [(r["instruction"], r["input"]) for r in train]
    assert len(set(keys)) == len(keys)
    assert not set(keys) & {(r["instruction"], r["input"]) for r in val}
    # Several checkable task types, each with enough records to learn from.
    by_task = {}
    for r in train:
        by_task[r["instruction"].split()[0]] = by_task.get(r["instruction"].split()[0], 0) + 1
    assert by_task["Sort"] > 150 and by_task["Reverse"] > 150 and by_task["Convert"] > 150
    # Spot-check the answers are right, not merely present.
    for r in train:
        if r["instruction"] == "Reverse the letters of the word.":
            assert r["output"] == r["input"][::-1]
        elif r["instruction"].startswith("What is ") and " + " in r["instruction"]:
            a, b = r["instruction"][8:-1].split(" + ")
            assert int(r["output"]) == int(a) + int(b)
        elif r["instruction"] == "Sort the numbers from smallest to largest.":
            assert r["output"] == ", ".join(map(str, sorted(int(x) for x in r["input"].split(", "))))


def test_sst2_sample_is_balanced_varied_and_disjoint():
    train, val = (
        _rows(SAMPLES / "sst2-sample" / "train.jsonl"),
        _rows(SAMPLES / "sst2-sample" / "validation.jsonl"),
    )
    assert (len(train), len(val)) == (900, 100)
    labels = [r["label"] for r in train + val]
    assert set(labels) == {0, 1} and labels.count(1) == 500
    assert not {r["sentence"] for r in train} & {r["sentence"] for r in val}
    vocab = {w.lower().strip(".,;:?!") for r in train for w in r["sentence"].split()}
    assert len(vocab) > 400  # not a handful of templates over a handful of words
    # Negation and contrast frames exist, so one keyword does not give the label away.
    assert any("not dull" in r["sentence"] or "not bland" in r["sentence"] for r in train if r["label"] == 1)


def test_chat_sample_is_multi_turn_checkable_and_disjoint():
    train, val = _rows(SAMPLES / "chat-sample" / "train.jsonl"), _rows(SAMPLES / "chat-sample" / "validation.jsonl")
    assert (len(train), len(val)) == (400, 40)
    for r in train + val:
        roles = [t["role"] for t in r["messages"]]
        body = roles[1:] if roles[0] == "system" else roles
        assert list(r) == ["messages"] and body[::2] == ["user"] * len(body[::2])
        assert body[1::2] == ["assistant"] * len(body[1::2]) and len(body) // 2 in (2, 3)
    opening = [next(t["content"] for t in r["messages"] if t["role"] == "user") for r in train]
    assert len(set(opening)) == len(opening)
    assert not set(opening) & {next(t["content"] for t in r["messages"] if t["role"] == "user") for r in val}
    assert 100 < sum(r["messages"][0]["role"] == "system" for r in train) < 170
    # the follow-up answers are right: they depend on the earlier turns
    for r in train:
        m = [t["content"] for t in r["messages"] if t["role"] != "system"]
        if m[0].startswith("What is ") and " + " in m[0]:
            a, b = m[0][8:-1].split(" + ")
            s = int(a) + int(b)
            assert m[1] == f"{a} + {b} = {s}."
            if m[2] == "And if you double it?":
                assert m[3] == f"Doubled, {s} is {2 * s}."
        elif m[2] == "Sort them alphabetically.":
            words = m[0].split(": ", 1)[1].split(". How")[0].split(", ")
            assert m[1] == f"There are {len(words)} words." and m[3] == ", ".join(sorted(words)) + "."


def test_embedded_tokenizer_has_4096_tokens_and_round_trips():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(EMBEDDED))
    assert len(tok) == 4096 and tok.backend_tokenizer.get_vocab_size() == 4096
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    texts = [r["output"] for r in _rows(SAMPLES / "alpaca-sample" / "validation.jsonl")]
    texts += [r["sentence"] for r in _rows(SAMPLES / "sst2-sample" / "validation.jsonl")]
    texts += ["Ünïcödé ✓ and text it never saw: 1234567 {}[]", "  two  spaces\n\ttab"]
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
    ids = tok("What is 12 + 7?").input_ids
    assert ids[0] == tok.bos_token_id  # Llama-style: <s> first
    digits = tok.convert_ids_to_tokens(tok("1234", add_special_tokens=False).input_ids)
    assert digits == ["1", "2", "3", "4"]  # one token per digit
    assert all(p.stat().st_size < 1_000_000 for p in EMBEDDED.iterdir())


def test_tokenizer_script_reproduces_shipped_tokenizer(tmp_path):
    _script("gen_tokenizer").main(["--out", str(tmp_path)])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (EMBEDDED / name).read_bytes(), name
