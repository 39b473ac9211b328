"""data.packing: several sequences per max_length block, and each trains exactly as it would alone.

The packed block goes through the real collate and the loop's forward arguments
(zfctl/train/loss.py ``model_inputs``: positions, no attention mask); each of its sequences goes
through the same path unpacked (attention mask, no positions). Per-token losses must agree within
fp32 rounding, with sdpa and with eager attention. The same block without its positions (attention
crossing the boundaries) must not agree: the comparison can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zfctl.errors import ConfigError
from zfctl.plan.schema import DataConfig, ModelConfig
from zfctl.plan.validate import PACKING_MODEL_TYPES, check_packing
from zfctl.train.data.prepare import format_debug_samples, prepare_data
from zfctl.train.loss import lm_loss_sum, model_inputs
from zfctl.train.models.load import build_from_config, load_tokenizer

IGNORE = -100
TINY = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256}


def conversation(i: int) -> list[dict]:
    turns = [{"role": "user", "content": f"What is {i} + {i + 3}?"},
             {"role": "assistant", "content": f"{i} + {i + 3} = {2 * i + 3}."}]
    if i % 2:
        turns = [{"role": "system", "content": "Answer with the sum."}, *turns,
                 {"role": "user", "content": "Double it."}, {"role": "assistant", "content": f"{4 * i + 6}."}]
    return turns


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


@pytest.fixture(scope="module")
def data(tmp_path_factory, tok):
    """The same 9 conversations unpacked and packed into 128-token blocks."""
    tmp = tmp_path_factory.mktemp("pack")
    f = tmp / "c.jsonl"
    f.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(9)))

    def prepare(packing: bool):
        cfg = DataConfig(name="c", source="local", path=str(f), template="chat", max_length=128,
                         packing=packing, validation_fraction=0.0)
        return prepare_data(cfg, tok, seed=0, cache_dir=tmp / "cache")

    return prepare(False), prepare(True)


def oracle_labels(tok, messages: list[dict]) -> list[int]:
    out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    return [t if m else IGNORE for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True)]


def test_blocks_hold_whole_conversations_with_restarting_positions(data, tok):
    unpacked, packed = data
    seqs = list(unpacked.train)
    assert [ex["labels"] for ex in seqs] == [oracle_labels(tok, conversation(i)) for i in range(9)]
    assert packed.stats.packed == 9 and len(packed.train) < 9 and "9 sequences packed" in packed.summary()
    k = 0
    for block in packed.train:
        assert len(block["input_ids"]) <= 128
        starts = [j for j, p in enumerate(block["position_ids"]) if p == 0]
        want_ids, want_labels, want_pos = [], [], []
        for _ in starts:  # the block is the next len(starts) conversations, whole, in order
            ex = seqs[k]
            want_ids += ex["input_ids"]
            want_labels += [IGNORE, *ex["labels"][1:]]
            want_pos += range(len(ex["input_ids"]))
            k += 1
        assert (block["input_ids"], block["labels"], block["position_ids"]) == (want_ids, want_labels, want_pos)
    assert k == 9 and any(b["position_ids"].count(0) > 1 for b in packed.train)
    first = packed.train[0]
    starts = ", ".join(str(j) for j, p in enumerate(first["position_ids"]) if p == 0)
    assert f"2 sequences packed, starting at tokens {starts}\n" in format_debug_samples(packed, tok, n=1)


# The architectures of the model presets (llama: tiny-llama, smollm2, llama*; gpt2; opt-350m).
ARCHS = {
    "llama": TINY,
    "gpt2": {"model_type": "gpt2", "vocab_size": 4096, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256},
    "opt": {"model_type": "opt", "vocab_size": 4096, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 256, "word_embed_proj_dim": 64},
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_batch_gives_the_per_token_loss_of_its_sequences_unpacked(data, tok, attn, arch):
    """For every model type data.packing accepts (plan/validate.py PACKING_MODEL_TYPES); one it
    refuses must really give other losses packed, else the refusal is not needed."""
    unpacked, packed = data
    supported = arch in PACKING_MODEL_TYPES
    model = build_from_config(ARCHS[arch], seed=3)
    model.set_attn_implementation(attn)
    model.eval()

    def token_losses(batch: dict) -> list[torch.Tensor]:
        """Per-row losses of the labelled tokens, in order."""
        with torch.no_grad():
            logits = model(**model_inputs(batch), use_cache=False).logits
        out = []
        for row in range(logits.shape[0]):
            labels = batch["labels"][row, 1:]
            loss = F.cross_entropy(logits[row, :-1], labels, ignore_index=IGNORE, reduction="none")
            out.append(loss[labels != IGNORE])
        return out

    # two blocks of different lengths in one micro-batch: the shorter one is right-padded
    batch = packed.collate([packed.train[0], packed.train[len(packed.train) - 1]])
    assert batch["attention_mask"][1].sum() < batch["attention_mask"].shape[1]
    got = torch.cat(token_losses(batch))
    n_first = batch["position_ids"][0].eq(0).sum().item()
    n_last = packed.train[len(packed.train) - 1]["position_ids"].count(0)
    alone = list(range(n_first)) + list(range(9 - n_last, 9))
    for i in alone:  # each sequence's mask is the template's own, so the tokens compared are the right ones
        assert unpacked.train[i]["labels"] == oracle_labels(tok, conversation(i))
    want = torch.cat([token_losses(unpacked.collate([unpacked.train[i]]))[0] for i in alone])
    assert got.shape == want.shape and got.numel() > 20
    if not supported:
        assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3), f"{arch} packs correctly: accept it"
        with pytest.raises(ConfigError, match=r"data\.packing=True: model type .* set data\.packing=false"):
            check_packing(True, model.config)
        return
    check_packing(True, model.config)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the summed loss the loop optimises, over the same tokens
    with torch.no_grad():
        total = lm_loss_sum(model(**model_inputs(batch), use_cache=False).logits, batch["labels"])
    torch.testing.assert_close(total, want.sum(), rtol=1e-5, atol=1e-4)
    # without its positions the block's later sequences attend to the earlier ones: not the same
    crossing = {k: v for k, v in batch.items() if k != "position_ids"}
    assert not torch.allclose(torch.cat(token_losses(crossing)), want, rtol=1e-3, atol=1e-3)


def test_text_packing_keeps_every_token_and_restarts_positions_per_document(tmp_path: Path, tok):
    docs = [f"document number {i} has some words in it" for i in range(5)]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = DataConfig(name="t", source="local", path=str(f), template="text", packing=True, max_length=16,
                     validation_fraction=0.0)
    p = prepare_data(cfg, tok, seed=0, cache_dir=tmp_path / "c")
    lengths = [len(tok(d, add_special_tokens=False).input_ids) + 2 for d in docs]  # <s> ... </s>
    positions = [q for ex in p.train for q in ex["position_ids"]]
    # a document that does not fit the rest of a block continues in the next, from position 0
    want, room = [], 16
    for n in lengths:
        while n:
            take = min(n, room)
            want += range(take)
            n, room = n - take, room - take or 16
    assert positions == want


def test_a_plan_that_packs_for_a_refused_model_type_is_refused_before_loading() -> None:
    from zfctl.plan import plan_from_dict

    data = {"template": "text", "packing": True}
    with pytest.raises(ConfigError, match=r"data\.packing=True: model type 'opt'"):
        plan_from_dict({"model": {"source": "config", "config": ARCHS["opt"]}, "data": data})
    plan_from_dict({"model": {"source": "config", "config": ARCHS["gpt2"]}, "data": data})  # accepted
