"""train.activation_checkpointing through the real loop: the same losses, and really on.

fp32 on the CPU, a 2-layer tiny-llama, ZenFlow selecting columns (topk 0.1, CPU update every 2
steps, gradient accumulation 2 so the gradient hooks see a recomputed backward more than once
per step). Recomputing a layer repeats its forward bit for bit in principle; the tolerance
(1e-6 relative) leaves room for a kernel that picks another reduction order for the recompute.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zfctl.errors import ConfigError
from zfctl.plan.resolve import resolve_plan
from zfctl.train import recipe as recipe_module
from zfctl.train import run
from zfctl.train.metrics import read_metrics
from zfctl.train.models.load import enable_activation_checkpointing

STEPS = 10
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=96", "data.max_length=64", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
    "train.eval_batches=1", "train.eval_every=0", "train.device=cpu", "train.precision=fp32", "train.lr=3e-3",
    f"train.max_steps={STEPS}", "zenflow.topk_ratio=0.1", "zenflow.update_interval=2",
    "zenflow.select_interval=4", "zenflow.full_warm_up_rounds=1",
]


LOAD = recipe_module.load_model


def _count_forward(module: torch.nn.Module, calls: list[int]) -> None:
    """Append to ``calls`` on every run of ``module.forward``. Not a forward hook: torch's
    non-reentrant checkpoint recomputes without firing module hooks."""
    forward = module.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    module.forward = counted  # type: ignore[method-assign]


def _run(out: Path, on: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[int]]:
    """Losses of every step, and how often decoder layer 0's MLP ran forward."""
    calls: list[int] = []
    load = LOAD

    def counted(*args, **kwargs):
        model = load(*args, **kwargs)
        _count_forward(model.model.layers[0].mlp, calls)
        return model

    monkeypatch.setattr(recipe_module, "load_model", counted)
    plan = resolve_plan("tiny-llama", "alpaca-sample",
                        overrides=[*TINY, f"checkpoint.output_dir={out}", f"train.activation_checkpointing={on}"])
    assert plan.train.activation_checkpointing is on
    result = run(plan)
    assert result.steps == STEPS
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")]
    # The final evaluation runs the layer once per batch too (no_grad: nothing to recompute).
    return losses, calls


@pytest.mark.slow
def test_checkpointing_on_and_off_train_the_same_losses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    off, calls_off = _run(tmp_path / "off", False, monkeypatch)
    on, calls_on = _run(tmp_path / "on", True, monkeypatch)
    assert len(off) == len(on) == STEPS
    assert off[-1] < off[0]  # it trained
    for a, b in zip(off, on, strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (off, on)
    # Really on: every training micro-batch runs layer 0's MLP twice (forward, then the
    # recompute in backward), once without; the final evaluation's batches once in both.
    micro = STEPS * 2
    evals = len(calls_off) - micro
    assert evals >= 1
    assert len(calls_on) == 2 * micro + evals


def test_enable_runs_each_layer_again_in_backward() -> None:
    """The switch itself, without a run: one forward + backward calls layer 0's MLP twice, and the
    recompute keeps the gradients (fp32: bit-identical here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    grads, counts = [], []
    for on in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).float().train()
        if on:
            enable_activation_checkpointing(model)
        n: list[int] = []
        _count_forward(model.model.layers[0].mlp, n)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        counts.append(len(n))
    assert counts == [1, 2]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_a_model_without_checkpointing_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing.*does not support.*=false"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_a_plan_that_still_says_auto_is_resolved_where_the_model_is_built(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A library plan (or an older plan.yaml) may still say auto: the recipe resolves it against
    the plan's machine, here one too small without the recompute, and saves the concrete value."""
    from zfctl.plan.fit import with_sets
    from zfctl.plan.memory import Machine, estimate

    calls: list[int] = []

    def counted(*args, **kwargs):
        model = LOAD(*args, **kwargs)
        _count_forward(model.model.layers[0].mlp, calls)
        return model

    monkeypatch.setattr(recipe_module, "load_model", counted)
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        *TINY, f"checkpoint.output_dir={tmp_path}", "train.max_steps=1", "train.activation_checkpointing=false",
        # fixed: host_accumulators and grad_layout auto would drop to one slot set or the carry under
        # the tight host limit below, other ways to fit, resolved before checkpointing
        "zenflow.tuning.host_accumulators=2", "zenflow.tuning.grad_layout=slots"])
    need = {}
    for on in (False, True):
        est = estimate(with_sets(plan, {"train.activation_checkpointing": on}), Machine(64e9, False))
        need[on] = est.host_total + est.device_total  # on the CPU the device lines live in host RAM
    host = int((need[False] + need[True]) / 2 / 0.75)  # between the two: zfctl/plan/memory.py host_limit
    plan = with_sets(plan, {"machine.host_memory": f"{host}B", "train.activation_checkpointing": "auto"})
    assert plan.train.activation_checkpointing == "auto"
    run(plan)
    assert len(calls) == 2 * 2 + 1  # one step of 2 micro-batches, each recomputed; the final evaluation's batch
    assert "activation_checkpointing: true" in (tmp_path / "plan.yaml").read_text()
