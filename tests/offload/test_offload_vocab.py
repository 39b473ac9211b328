"""zenflow.vocab_select: the token-indexed matrices (embedding, output head) choose rows (tokens)
instead of columns (hidden dimensions) under 'rows', and nothing changes under 'columns'.

The math of a row-split matrix against a literal statement of the algorithm is in
test_offload_reference.py; its resume and data-parallel exactness in test_offload_checkpoint.py
and test_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from test_offload_helpers import batches, snapshot, tiny_net, train, zen

from zfctl.errors import ConfigError
from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer, vocab_matrices

VOCAB, DIM = 100, 8
HP = {"lr": 1e-2, "weight_decay": 0.01}


class TokenNet(torch.nn.Module):
    """Embedding -> Linear -> output head over the same vocabulary: a language model's skeleton."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.mid = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def _token_steps(model: TokenNet, opt: ZenFlowOptimizer, steps: int, used: list[int]) -> None:
    """Next-token loss on sequences drawn from the tokens ``used`` only."""
    g = torch.Generator().manual_seed(3)
    pool = torch.tensor(used)
    for _ in range(steps):
        seq = pool[torch.randint(len(used), (4, 9), generator=g)]
        logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def test_rows_puts_the_tokens_in_play_on_the_device() -> None:
    """A batch that uses 6 of 100 tokens: under 'rows' the embedding's and the head's device rows
    (k = 10) include all 6; the Linear in between still chooses columns."""
    used = [3, 7, 19, 42, 64, 90]
    model = TokenNet()
    cfg = zen(topk_ratio=0.1, update_interval=2, select_interval=2, vocab_select="rows")
    with ZenFlowOptimizer(model.named_parameters(), cfg, vocab_params=["embed.weight", "head.weight"], **HP) as opt:
        _token_steps(model, opt, 4, used)
        slots = {s.name: s for s in opt.layout.slots}
        chosen = {s.name: opt.device_state.index[s.index] for s in opt.layout.slots if s.selects}
    assert (slots["embed.weight"].by_row, slots["head.weight"].by_row, slots["mid.weight"].by_row) == (True, True, False)
    assert (slots["embed.weight"].cols, slots["embed.weight"].k, slots["mid.weight"].k) == (VOCAB, 10, 1)
    for name in ("embed.weight", "head.weight"):
        assert set(used) <= set(chosen[name].tolist()), name


def test_columns_ignores_the_vocab_names_bit_for_bit() -> None:
    """'columns' (the paper's) with the vocabulary named is the engine without them."""
    cfg = zen(topk_ratio=0.1, update_interval=4, select_interval=8, deferred_lr_scale="repeat")
    results = []
    for names in ([], ["fc2.weight", "head.weight"]):
        model = tiny_net()
        with ZenFlowOptimizer(model.named_parameters(), cfg, vocab_params=names, **HP) as opt:
            train(model, opt, 16)
            opt.flush()
            assert not any(s.by_row for s in opt.layout.slots)
        results.append(snapshot(model))
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])


def test_rows_changes_only_the_named_matrices() -> None:
    """Under 'rows' the named matrices' slots are transposed (same elements, device memory within
    one column of the column split) and every other slot is as under 'columns'; the trajectory
    differs (the comparison has teeth)."""
    names = ["fc2.weight", "head.weight"]
    layouts, out = {}, {}
    for mode in ("columns", "rows"):
        model = tiny_net()
        cfg = zen(topk_ratio=0.25, update_interval=2, vocab_select=mode)
        with ZenFlowOptimizer(model.named_parameters(), cfg, vocab_params=names, **HP) as opt:
            train(model, opt, 8)
            opt.flush()
            layouts[mode] = {s.name: s for s in opt.layout.slots}
        out[mode] = snapshot(model)
    for name, col in layouts["columns"].items():
        row = layouts["rows"][name]
        if name in names:
            assert (row.rows, row.cols, row.by_row) == (col.cols, col.rows, True)
            assert abs(row.k * row.rows - col.k * col.rows) <= max(row.rows, col.rows)
        else:
            assert (row.rows, row.cols, row.k, row.by_row) == (col.rows, col.cols, col.k, False)
    assert any(not torch.equal(out["rows"][n], out["columns"][n]) for n in names)


def test_vocab_params_must_name_trainable_parameters() -> None:
    model = tiny_net()
    with pytest.raises(ValueError, match=r"vocab_params names no trainable parameter: \['lm_head.weight'\]"):
        ZenFlowOptimizer(model.named_parameters(), ZenFlowConfig(), vocab_params=["lm_head.weight"])


def test_vocab_select_rejects_other_values() -> None:
    with pytest.raises(ConfigError, match="zenflow.vocab_select") as e:
        ZenFlowConfig(vocab_select="tokens").validate()  # type: ignore[arg-type]
    assert "use one of columns, rows" in str(e.value)


def test_vocab_matrices_finds_embedding_and_head() -> None:
    """transformers models: input embedding and output head (a tied pair once); other modules:
    every nn.Embedding; frozen ones are left out."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2}
    untied = LlamaForCausalLM(LlamaConfig(**kw, tie_word_embeddings=False))
    assert vocab_matrices(untied) == ["model.embed_tokens.weight", "lm_head.weight"]
    tied = LlamaForCausalLM(LlamaConfig(**kw, tie_word_embeddings=True))
    assert vocab_matrices(tied) == ["model.embed_tokens.weight"]
    plain = TokenNet()
    assert vocab_matrices(plain) == ["embed.weight"]
    plain.embed.weight.requires_grad_(False)
    assert vocab_matrices(plain) == []


def test_a_row_split_matrix_wholly_on_the_device_is_adamw_bit_for_bit() -> None:
    """topk 1: every matrix is device-owned from step 0, so a row split changes only how its
    state is laid out (the transposed load and write-back), never a value: both modes give the
    same weights, bit for bit. (The selected-row gather is checked by test_offload_reference.py.)"""
    out = []
    for mode in ("columns", "rows"):
        model = tiny_net()
        cfg = zen(topk_ratio=1.0, vocab_select=mode)
        with ZenFlowOptimizer(model.named_parameters(), cfg, vocab_params=["fc2.weight", "head.weight"], **HP) as opt:
            for x, y in batches(6):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        out.append(snapshot(model))
    assert all(torch.equal(out[0][n], out[1][n]) for n in out[0])
