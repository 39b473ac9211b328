"""prepare_data end to end on small hand-made files with the embedded tokenizer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from zfctl.errors import ConfigError, UserError
from zfctl.plan.schema import DataConfig, ModelConfig
from zfctl.train.data.prepare import format_debug_samples, prepare_data
from zfctl.train.models import hub as model_hub
from zfctl.train.models.load import load_tokenizer

IGNORE = -100


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def local(path: Path, **kw) -> DataConfig:
    return DataConfig(name=str(path), source="local", path=str(path), **kw)


def test_alpaca_masks_exactly_the_prompt(tmp_path, tok):
    f = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            {"instruction": "Say hi.", "output": "hi there"},
        ],
    )
    data = prepare_data(local(f, validation_fraction=0.0), tok, seed=0, cache_dir=tmp_path / "c")
    ex = data.train[0]
    prompt = "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"
    prompt_ids = tok(prompt, add_special_tokens=False).input_ids
    five = tok.convert_tokens_to_ids("5")
    assert ex["input_ids"] == [tok.bos_token_id, *prompt_ids, five, tok.eos_token_id]
    assert ex["labels"] == [IGNORE] * (1 + len(prompt_ids)) + [five, tok.eos_token_id]
    # No input field: the short prompt, and the whole response + EOS in the loss.
    ex = data.train[1]
    prompt_ids = tok("### Instruction:\nSay hi.\n\n### Response:\n", add_special_tokens=False).input_ids
    answer = tok("hi there", add_special_tokens=False).input_ids
    assert ex["labels"] == [IGNORE] * (1 + len(prompt_ids)) + answer + [tok.eos_token_id]
    assert tok.decode([x for x in ex["labels"] if x != IGNORE]) == "hi there</s>"
    shown = format_debug_samples(data, tok, n=1)
    n_masked = 1 + len(tok(prompt, add_special_tokens=False).input_ids)
    assert f"<s>{prompt}⟦5</s>⟧" in shown and f"(labels: {n_masked}×-100, 2×loss)" in shown


def test_slicing_and_seeded_hold_out(tmp_path, tok):
    rows = [{"instruction": f"Item {i}.", "input": "", "output": f"r{i}"} for i in range(10)]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    cache = tmp_path / "c"

    def outputs(ds):
        return [tok.decode([x for x in ex["labels"] if x != IGNORE][:-1]) for ex in ds]

    d = prepare_data(local(f, start_idx=2, end_idx=7, validation_fraction=0.0), tok, seed=0, cache_dir=cache)
    assert outputs(d.train) == ["r2", "r3", "r4", "r5", "r6"] and d.eval is None
    d = prepare_data(
        local(f, start_idx=8, end_idx=100, validation_fraction=0.0), tok, seed=0, cache_dir=cache
    )
    assert outputs(d.train) == ["r8", "r9"]  # end_idx past the end is clipped
    a = prepare_data(local(f, validation_fraction=0.2), tok, seed=1, cache_dir=cache)
    b = prepare_data(local(f, validation_fraction=0.2), tok, seed=1, cache_dir=tmp_path / "other")
    c = prepare_data(local(f, validation_fraction=0.2), tok, seed=2, cache_dir=cache)
    assert (len(a.train), len(a.eval)) == (8, 2)
    assert sorted(outputs(a.train) + outputs(a.eval)) == sorted(f"r{i}" for i in range(10))
    assert outputs(a.eval) == outputs(b.eval) != outputs(c.eval)  # the seed decides, nothing else
    with pytest.raises(ConfigError, match=r"^data\.start_idx=10: .* has 10 records"):
        prepare_data(local(f, start_idx=10), tok, seed=0, cache_dir=cache)
    with pytest.raises(ConfigError, match=r"^data\.end_idx=3: must be greater than data\.start_idx=5"):
        prepare_data(local(f, start_idx=5, end_idx=3), tok, seed=0, cache_dir=cache)


GOOD = {"instruction": "Do it.", "input": "", "output": "done"}


@pytest.mark.parametrize(
    "bad,field,problem",
    [
        ({"instruction": "Do it.", "input": ""}, "output", "is missing"),
        ({"instruction": "Do it.", "output": 42}, "output", "must be a string, got int"),
        ({"instruction": "   ", "output": "x"}, "instruction", "is empty"),
        ({"instruction": "Do it.", "input": ["a"], "output": "x"}, "input", "must be a string, got list"),
        (["not", "an", "object"], "<record>", "must be an object"),
    ],
)
def test_bad_alpaca_record_is_named_by_file_index_and_field(tmp_path, tok, bad, field, problem):
    f = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, GOOD, bad, GOOD])
    with pytest.raises(UserError) as e:
        prepare_data(local(f), tok, seed=0, cache_dir=tmp_path / "c")
    assert str(e.value).startswith(f"{f}: record 4: field {field!r} {problem}")  # counted from 1
    assert "\n" not in str(e.value)


def test_bad_files_and_other_templates_fail_with_one_line(tmp_path, tok):
    f = tmp_path / "broken.jsonl"
    f.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(UserError, match=r"broken\.jsonl: line 2 \(record 2\) is not valid JSON"):
        prepare_data(local(f), tok, seed=0, cache_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match=r"^data\.path='.*missing\.jsonl': no such file"):
        prepare_data(local(tmp_path / "missing.jsonl"), tok, seed=0, cache_dir=tmp_path / "c")
    g = write_jsonl(
        tmp_path / "cls.jsonl", [{"sentence": "fine", "label": 1}, {"sentence": "odd", "label": 2}]
    )
    cfg = local(g, template="classification", text_field="sentence", label_names=["neg", "pos"])
    with pytest.raises(
        UserError, match=r"cls\.jsonl: record 2: field 'label' is 2, outside data\.label_names"
    ):
        prepare_data(cfg, tok, seed=0, cache_dir=tmp_path / "c")
    h = write_jsonl(tmp_path / "txt.jsonl", [{"text": "ok"}, {"body": "no text"}])
    with pytest.raises(
        UserError, match=r"txt\.jsonl: record 2: field 'text' is missing \(the record has 'body'\)"
    ):
        prepare_data(local(h, template="text"), tok, seed=0, cache_dir=tmp_path / "c")


def test_shipped_samples_classification_and_named_split(tmp_path, tok):
    cfg = DataConfig(
        name="sst2-sample",
        source="sample",
        template="classification",
        text_field="sentence",
        label_names=["negative", "positive"],
        validation_split="validation",
    )
    d = prepare_data(cfg, tok, seed=0, cache_dir=tmp_path)
    assert (len(d.train), len(d.eval)) == (900, 100)
    first = json.loads(
        (Path(__file__).resolve().parents[2] / "presets/samples/sst2-sample/train.jsonl").read_text().splitlines()[0]
    )
    ex = d.train[0]
    assert tok.decode(ex["input_ids"]) == (
        f"<s>### Text:\n{first['sentence']}\n\n### Label:\n{['negative', 'positive'][first['label']]}</s>"
    )
    assert tok.decode([x for x in ex["labels"] if x != IGNORE]) in ("negative</s>", "positive</s>")
    a = prepare_data(
        DataConfig(name="alpaca-sample", source="sample", validation_split="validation"),
        tok,
        seed=0,
        cache_dir=tmp_path,
    )
    assert (a.stats.train, a.stats.eval, a.stats.dropped) == (1880, 120, 0)
    with pytest.raises(
        ConfigError, match=r"^data\.path='nope': no shipped sample .*alpaca-sample, chat-sample, sst2-sample"
    ):
        prepare_data(DataConfig(name="nope", source="sample"), tok, seed=0, cache_dir=tmp_path)


def test_truncation_drops_prompt_only_sequences_and_packing_keeps_every_token(tmp_path, tok):
    long_prompt = {"instruction": "word " * 40, "output": "x"}
    f = write_jsonl(
        tmp_path / "d.jsonl", [long_prompt, {"instruction": "Hi.", "output": "a b c d e f g h i j"}]
    )
    d = prepare_data(local(f, max_length=18, validation_fraction=0.0), tok, seed=0, cache_dir=tmp_path / "c")
    assert d.stats.dropped == 1 and len(d.train) == 1
    assert len(d.train[0]["input_ids"]) == 18 and d.train[0]["labels"][-1] != tok.eos_token_id

    docs = [{"text": f"document number {i} has some words in it"} for i in range(5)]
    g = write_jsonl(tmp_path / "t.jsonl", docs)
    p = prepare_data(
        local(g, template="text", packing=True, max_length=16, validation_fraction=0.0),
        tok,
        seed=0,
        cache_dir=tmp_path / "c",
    )
    blocks = [ex["input_ids"] for ex in p.train]
    assert all(len(b) == 16 for b in blocks[:-1]) and 0 < len(blocks[-1]) <= 16
    stream = []
    for doc in docs:
        stream += [tok.bos_token_id, *tok(doc["text"], add_special_tokens=False).input_ids, tok.eos_token_id]
    assert [t for b in blocks for t in b] == stream
    # Plain LM: every token is a label except each document's <s> (nothing predicts it).
    assert p.train[0]["labels"] == [IGNORE if t == tok.bos_token_id else t for t in blocks[0]]


def test_csv_and_parquet_values_are_kept_as_written(tmp_path, tok):
    import datasets

    csv = tmp_path / "d.csv"
    csv.write_text('instruction,input,output\n"What is 40 + 2?",,42\n"Say it.",x,007\n')
    d = prepare_data(local(csv, validation_fraction=0.0), tok, seed=0, cache_dir=tmp_path / "c")
    assert [tok.decode([x for x in ex["labels"] if x != IGNORE]) for ex in d.train] == ["42</s>", "007</s>"]
    pq = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"instruction": "A.", "input": "", "output": "b"}] * 3).to_parquet(str(pq))
    d = prepare_data(local(pq, validation_fraction=0.0), tok, seed=0, cache_dir=tmp_path / "c")
    assert len(d.train) == 3


def test_cache_hit_is_identical_and_keys_on_config_and_file(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 4)
    cache = tmp_path / "c"
    first = prepare_data(local(f), tok, seed=0, cache_dir=cache)
    again = prepare_data(local(f), tok, seed=0, cache_dir=cache)
    assert not first.stats.from_cache and again.stats.from_cache
    assert again.cache_path == first.cache_path and list(again.train) == list(first.train)
    other = prepare_data(local(f, max_length=64), tok, seed=0, cache_dir=cache)
    assert other.cache_path != first.cache_path
    write_jsonl(f, [GOOD] * 5)  # the file changed: a new entry, not the stale one
    changed = prepare_data(local(f), tok, seed=0, cache_dir=cache)
    assert not changed.stats.from_cache and changed.stats.records == 5
    assert len(list(cache.iterdir())) == 3 and not any(p.name.startswith(".") for p in cache.iterdir())


def test_collate_right_pads(tmp_path, tok):
    f = write_jsonl(
        tmp_path / "d.jsonl", [GOOD, {"instruction": "Longer instruction here.", "output": "yes"}]
    )
    d = prepare_data(local(f, validation_fraction=0.0), tok, seed=0, cache_dir=tmp_path / "c")
    a, b = d.train[0], d.train[1]
    batch = d.collate([a, b])
    n = max(len(a["input_ids"]), len(b["input_ids"]))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, n)
    k = len(a["input_ids"])
    assert batch["input_ids"][0, :k].tolist() == a["input_ids"]
    assert batch["input_ids"][0, k:].eq(tok.pad_token_id).all() and batch["labels"][0, k:].eq(IGNORE).all()
    assert batch["attention_mask"][0].tolist() == [1] * k + [0] * (n - k)


def test_hub_dataset_fails_fast_when_offline(monkeypatch, tmp_path, tok):
    monkeypatch.setattr(model_hub, "_probe_result", {})
    monkeypatch.setattr(model_hub, "hub_endpoint", lambda: "https://hub.invalid")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        prepare_data(DataConfig(name="tatsu-lab/alpaca", source="hub"), tok, seed=0, cache_dir=tmp_path)
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert msg.startswith(
        "data.path='tatsu-lab/alpaca': the Hugging Face hub (https://hub.invalid) cannot be reached"
    )
    assert "alpaca-sample" in msg and "HF_HUB_OFFLINE=1" in msg


def test_validation_file_by_path_or_by_sibling_name(tmp_path, tok):
    rows = [{"text": f"doc {i}"} for i in range(6)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    held = write_jsonl(elsewhere / "held.jsonl", rows[:2])
    # An absolute path to a file in another folder (was a ValueError from pathlib).
    d = prepare_data(local(train, template="text", validation_split=str(held)), tok, seed=0, cache_dir=tmp_path / "c")
    assert (len(d.train), len(d.eval)) == (6, 2)
    write_jsonl(tmp_path / "validation.jsonl", rows[:3])  # a split name: the sibling file
    d = prepare_data(local(train, template="text", validation_split="validation"), tok, seed=0,
                     cache_dir=tmp_path / "c")
    assert len(d.eval) == 3
    with pytest.raises(ConfigError, match="data.validation_split"):
        prepare_data(local(train, template="text", validation_split=str(elsewhere / "nope.jsonl")), tok, seed=0,
                     cache_dir=tmp_path / "c")


def test_train_digest_follows_the_tokens_not_the_arrow_chunks(tmp_path, tok):
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    from zfctl.train.data.prepare import sequences_digest

    rows = [{**GOOD, "output": f"answer {i}"} for i in range(12)]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    fresh = prepare_data(local(f), tok, seed=0, cache_dir=tmp_path / "c")
    cached = prepare_data(local(f), tok, seed=0, cache_dir=tmp_path / "c")
    assert cached.stats.from_cache and cached.train_digest == fresh.train_digest
    table = fresh.train.to_dict()
    one = datasets.Dataset.from_dict(table, features=fresh.train.features)
    arrow = one.data.table
    # two chunks, the second a slice (its list offsets do not start at 0)
    parts = datasets.Dataset(InMemoryTable(pa.concat_tables([arrow.slice(0, 5), arrow.slice(5)])))
    assert parts.data.table.column("input_ids").num_chunks == 2
    assert sequences_digest(one) == sequences_digest(parts) == fresh.train_digest
    # one label more, one label less: the lengths differ, the concatenated ids alone would not
    table["labels"][0], table["labels"][1] = table["labels"][0] + table["labels"][1][:1], table["labels"][1][1:]
    assert sequences_digest(datasets.Dataset.from_dict(table, features=fresh.train.features)) != fresh.train_digest
    rows[3]["output"] = "answer 99"  # same record count, other tokens
    edited = prepare_data(local(write_jsonl(tmp_path / "d.jsonl", rows)), tok, seed=0, cache_dir=tmp_path / "c")
    assert len(edited.train) == len(fresh.train) and edited.train_digest != fresh.train_digest
