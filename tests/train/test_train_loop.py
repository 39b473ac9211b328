"""The training loop on its own: loss normalisation, gradient accumulation, eval, metrics, signals.

These drive `FinetuneRecipe.train` (zfctl/train/recipe.py) with parts put in by hand instead of
`setup`: a tiny Llama and `torch.optim.AdamW` behind the optimizer interface, to pin down what
the loop itself computes; the ZenFlow optimizer and the full run/resume lifecycle are exercised
in test_resume*.py.
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zfctl.plan.schema import CheckpointConfig, LoggingConfig, RunPlan, TrainConfig
from zfctl.train.data.sampler import ResumableSampler
from zfctl.train.display import NullDisplay, format_train_line
from zfctl.train.dist import DistEnv
from zfctl.train.loss import evaluate, lm_loss_sum
from zfctl.train.metrics import MetricsWriter, read_metrics
from zfctl.train.recipe import FinetuneRecipe
from zfctl.train.schedule import build_scheduler
from zfctl.train.signals import Interrupted

VOCAB = 64


class AdamWBehindInterface(torch.optim.AdamW):
    """torch AdamW with the optimizer interface the loop drives (no offload at all)."""

    def scale_loss(self, loss):
        return loss

    def prepare_backward(self, *, final):
        pass  # no gradient streaming: step() reads the .grad fields

    def step(self):
        super().step()
        return SimpleNamespace(device_opt_ms=0.0, stall_ms=0.0, cpu_step_ms=0.0, boundary=False,
                               selection=False, warmup=False, skipped=False, selected_fraction=1.0,
                               select_stay=None, grad_norm=None, loss_scale=None, update_interval=1, d2h_bytes=0,
                               h2d_bytes=0)

    def flush(self):
        pass


def _model():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).float()


def _data(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 5 + i % 6
        ids = torch.randint(4, VOCAB, (length,), generator=g).tolist()
        labels = [-100] * 2 + ids[2:]  # a 2-token "prompt" without loss
        out.append({"input_ids": ids, "labels": labels})
    return out


def collate(examples):
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[r, :n] = torch.tensor(e["input_ids"])
        labels[r, :n] = torch.tensor(e["labels"])
        mask[r, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _recipe(tmp_path, *, mbs, ga, steps=3, every=0, metrics=True, lr=1e-2):
    """A recipe as `setup` would leave it, with stand-in parts; `save_checkpoint` only returns a path."""
    plan = RunPlan(
        train=TrainConfig(micro_batch_size=mbs, gradient_accumulation_steps=ga, max_steps=steps, eval_every=every,
                          eval_batches=8, device="cpu", precision="fp32"),
        checkpoint=CheckpointConfig(output_dir=str(tmp_path), every=every), logging=LoggingConfig(every=1))
    data = _data()
    r = FinetuneRecipe(plan, SimpleNamespace(train=data, eval=data[:6], collate=collate), DistEnv())  # memorisable: eval loss must fall
    r.model = _model()
    r.optimizer = AdamWBehindInterface(r.model.parameters(), lr=lr)
    r.scheduler = build_scheduler(r.optimizer, "constant", warmup_steps=0, total_steps=steps)
    r.sampler = ResumableSampler(len(data), mbs, seed=3)
    r.total_steps = steps
    r.metrics = MetricsWriter(tmp_path) if metrics else None
    r.display = NullDisplay()
    r.save_checkpoint = lambda step: tmp_path / f"ckpt-{step}"
    return r


def test_loss_is_mean_over_target_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, VOCAB)
    labels = torch.tensor([[-100, 5, 6, -100], [-100, -100, 7, 8]])
    expect = torch.nn.functional.cross_entropy(
        torch.stack([logits[0, 0], logits[0, 1], logits[1, 1], logits[1, 2]]), torch.tensor([5, 6, 7, 8]),
        reduction="sum")
    assert torch.allclose(lm_loss_sum(logits, labels), expect)


def test_accumulation_matches_one_big_batch(tmp_path):
    """ga=2 x mbs=2 sees the same samples as ga=1 x mbs=4 and must give the same update: the loss
    is normalised by the step's token count, not averaged per micro-batch."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, b = _recipe(tmp_path / "a", mbs=4, ga=1), _recipe(tmp_path / "b", mbs=2, ga=2)
    ra, rb = a.train(), b.train()
    assert ra.steps == rb.steps == 3
    la = [r["loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl", "train")]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl", "train")]
    assert la == pytest.approx(lb, rel=1e-5)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.allclose(pa, pb, atol=1e-5)
    assert ra.final_eval_loss == pytest.approx(rb.final_eval_loss, rel=1e-5)


def test_training_lowers_loss_and_records_metrics(tmp_path):
    x = _recipe(tmp_path, mbs=4, ga=1, steps=12, every=4)
    saved = []

    def save(step):  # a real save_checkpoint reads the counters from x.progress
        saved.append((step, x.progress.tokens_seen))
        return tmp_path / str(step)

    x.save_checkpoint = save
    first_eval = evaluate(x.model, x.data.eval, collate, x.device, micro_batch_size=4, max_batches=8)
    res = x.train()
    x.metrics.close()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    train_recs = [r for r in recs if r["kind"] == "train"]
    evals = [(r["step"], r["eval_loss"]) for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in train_recs] == list(range(1, 13))
    assert [s for s, _ in evals] == [0, 4, 8, 12]
    assert evals[0][1] == first_eval  # the step-0 baseline is the untrained model's loss
    assert evals[-1][1] == res.final_eval_loss < evals[2][1] < first_eval
    assert train_recs[-1]["loss"] == res.final_train_loss < train_recs[0]["loss"]
    # tokens: attention-mask tokens, counted exactly; checkpoints at 4, 8 and the end
    assert train_recs[-1]["tokens_seen"] == sum(r["tokens"] for r in train_recs)
    assert [s for s, _ in saved] == [4, 8, 12]
    assert saved[-1][1] == train_recs[-1]["tokens_seen"]
    line = format_train_line(train_recs[-1], 12)
    assert line.startswith("step 12/12 | loss ") and "tok/s" in line and "fwd/bwd" in line


def test_sigterm_finishes_step_checkpoints_and_exits_143(tmp_path):
    x = _recipe(tmp_path, mbs=4, ga=1, steps=50)
    saved, calls = [], []

    def collate_then_signal(examples):
        calls.append(1)
        if len(calls) == 3:  # while the 3rd step loads its batch
            os.kill(os.getpid(), signal.SIGTERM)
        return collate(examples)

    x.data.collate = collate_then_signal
    x.save_checkpoint = lambda step: saved.append(step) or tmp_path / f"step-{step}"
    with pytest.raises(Interrupted) as e:
        x.train()
    assert e.value.code == 143 and saved == [3]
    assert "zfctl resume" in e.value.message and "after step 3" in e.value.message
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_console_line_is_dense_and_exact():
    rec = {"step": 40, "loss": 3.41214, "loss_steps": 10, "lr": 2e-4, "tokens_per_s": 5321.0,
           "step_ms": 182.4, "compute_ms": 150.2, "device_opt_ms": 20.1, "stall_ms": 12.0,
           "cpu_step_ms": 41.0, "selected_fraction": 0.1, "grad_norm": 1.234, "loss_scale": None,
           "skipped": False, "host_peak_gib": 1.24, "device_peak_gib": 0.81}
    assert format_train_line(rec, 200) == (
        "step  40/200 | loss 3.4121 (avg 10) | lr 2.00e-04 | 5.3k tok/s | 182 ms = fwd/bwd 150 + opt 20"
        " + stall 12 | cpu-adam 41 ms | sel 0.10 | gnorm 1.23 | dev 0.8G host 1.2G")


def test_the_line_after_a_selection_says_how_many_device_columns_stayed():
    """``select_stay`` of a selection step shows as ``stay`` on the next console line only."""
    from rich.console import Console

    from zfctl.train.display import RichDisplay

    base = {"step": 1, "loss": 1.0, "lr": 2e-4, "tokens_per_s": 5321.0, "step_ms": 182.4, "compute_ms": 150.2,
            "device_opt_ms": 20.1, "stall_ms": 12.0, "selected_fraction": 0.1, "host_peak_gib": 1.24}
    assert format_train_line({**base, "select_stay": 0.4321}, 200).endswith("| sel 0.10 stay 0.43 | host 1.2G")
    console = Console(record=True, width=400)
    display = RichDisplay(console, legend=False)
    for step, stay, line in [(1, None, False), (2, 0.55, False), (3, None, True), (4, None, True)]:
        display.step({**base, "step": step, **({"select_stay": stay} if stay is not None else {})}, line=line)
    printed = [ln for ln in console.export_text().splitlines() if ln.startswith("step")]
    assert ["stay 0.55" in ln for ln in printed] == [True, False]


def test_resume_truncates_metrics_after_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "eval", "step": 2, "eval_loss": 1.5}\n'
                    '{"kind": "train", "step": 3, "loss": 1.0}\n{"kind": "tra')  # torn by a kill
    w = MetricsWriter(tmp_path, resume_step=2)
    w.log({"kind": "train", "step": 3, "loss": 0.5})
    w.close()
    assert [(r["kind"], r["step"]) for r in read_metrics(path)] == [("train", 1), ("eval", 2), ("train", 3)]
    assert read_metrics(path, "train")[-1]["loss"] == 0.5


def test_missing_logger_package_is_a_user_error(monkeypatch):
    import importlib.util

    from zfctl.errors import UserError
    from zfctl.train.metrics import require_sinks

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    require_sinks(wandb=False, tensorboard=False)
    with pytest.raises(UserError, match="pip install tensorboard"):
        require_sinks(wandb=False, tensorboard=True)
    with pytest.raises(UserError, match="pip install wandb"):
        require_sinks(wandb=True, tensorboard=False)
