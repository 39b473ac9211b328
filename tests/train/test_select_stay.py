"""ZenFlow's premise, measured: each selection after the first records in ``metrics.jsonl`` the
share of the device's columns that stayed (``select_stay``), exactly as the selected sets say."""

from __future__ import annotations

import torch

from zfctl.offload.columns.selector import Selector
from zfctl.plan.resolve import resolve_plan
from zfctl.train import run
from zfctl.train.metrics import read_metrics

SETS = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=48", "data.max_length=64", "train.micro_batch_size=4", "train.device=cpu",
    "train.precision=fp32", "train.eval_every=0", "train.max_steps=5", "checkpoint.every=0",
    "zenflow.topk_ratio=0.1", "zenflow.update_interval=2", "zenflow.select_interval=2",
    "zenflow.full_warm_up_rounds=1", "zenflow.cpu_threads=1",
]


def test_selection_steps_record_the_share_of_device_columns_that_stay(tmp_path, monkeypatch) -> None:
    """Selections at steps 2 and 4 (W = 1, every 2 steps): step 4's record holds the share of
    step 2's device columns, over every matrix, that step 4 chose again, recomputed here one
    matrix at a time from the ids the selector held before and after; no other record has it."""
    sets: list[list[torch.Tensor]] = []
    original = Selector.select

    def select(self, grads, host, stats, **kw):
        out = original(self, grads, host, stats, **kw)
        sets.append([self.device.index_cpu[s.index].clone() for s in self.selectable])
        return out

    monkeypatch.setattr(Selector, "select", select)
    out = tmp_path / "run"
    run(resolve_plan("tiny-llama", "alpaca-sample", overrides=[*SETS, f"checkpoint.output_dir={out}"]))
    recs = read_metrics(out / "metrics.jsonl", "train")
    assert [r["step"] for r in recs if r["selection"]] == [2, 4] and len(sets) == 2
    stayed = sum(int(torch.isin(new, old).sum()) for old, new in zip(*sets))
    expected = stayed / sum(old.numel() for old in sets[0])
    assert [r["step"] for r in recs if "select_stay" in r] == [4]
    assert recs[3]["select_stay"] == expected and 0 < expected < 1
