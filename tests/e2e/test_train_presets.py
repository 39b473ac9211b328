"""Every shipped zenflow preset trains through the same loop, and the run folder rules hold."""

from __future__ import annotations

import pytest

from zfctl.errors import UserError
from zfctl.plan.resolve import resolve_plan
from zfctl.resources import presets_root
from zfctl.train import run
from zfctl.train.metrics import read_metrics
from zfctl.train.rundir import check_output_dir, clear_run_dir

TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=48", "data.max_length=64", "train.micro_batch_size=4", "train.eval_batches=1",
    "train.device=cpu", "train.precision=fp32", "train.lr=1e-3", "train.eval_every=0",
    "train.max_steps=4", "checkpoint.every=0", "train.warmup_steps=0", "train.schedule=constant",
]
PRESETS = sorted(p.stem for p in (presets_root() / "zenflow").glob("*.yaml"))


def _run(tmp_path, preset, *extra):
    out = tmp_path / preset
    plan = resolve_plan("tiny-llama", "alpaca-sample", zenflow=preset,
                        overrides=[*TINY, f"checkpoint.output_dir={out}", *extra])
    result = run(plan)
    return result, read_metrics(out / "metrics.jsonl", "train"), plan


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("presets")
    return {p: _run(tmp, p) for p in PRESETS}


def test_presets_shipped():
    assert {"default", "paper", "off", "zero-offload", "aggressive"} <= set(PRESETS)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_trains(runs, preset):
    result, recs, plan = runs[preset]
    assert result.steps == 4 and [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert result.last_checkpoint.name == "step-000004"
    boundaries = [r["step"] for r in recs if r["boundary"]]
    z = plan.zenflow
    if z.topk_ratio == 1.0:  # off: everything on the device, nothing offloaded
        assert all(r["selected_fraction"] == 1.0 and r["d2h_bytes"] == 0 for r in recs)
        assert boundaries == []
    elif z.update_interval == 1:  # zero-offload: a synchronous CPU update every step
        assert boundaries == [1, 2, 3, 4] and all(r["d2h_bytes"] > 0 for r in recs)
    else:  # ZenFlow: W warm-up steps (a synchronous CPU update of every matrix each), selection
        # at step W+1, then the first CPU update fires update_interval steps after the warm-up
        w = min(z.full_warm_up_rounds, 4)
        first = w + z.update_interval
        assert boundaries == list(range(1, w + 1)) + ([first] if first <= 4 else [])
        assert all(r["selected_fraction"] == 0 for r in recs[:w])
        assert all(0 < r["selected_fraction"] < 1 for r in recs[w:])


@pytest.mark.slow
def test_off_and_zero_offload_agree(runs):
    """Both are plain AdamW (one on the device, one on the CPU): the same losses to float noise."""
    off = [r["loss"] for r in runs["off"][1]]
    zero = [r["loss"] for r in runs["zero-offload"][1]]
    assert off == pytest.approx(zero, rel=1e-4)
    assert runs["off"][0].final_eval_loss == pytest.approx(runs["zero-offload"][0].final_eval_loss, rel=1e-4)


def test_debug_data_prints_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "dbg"
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[*TINY, f"checkpoint.output_dir={out}"])
    result = run(plan, debug_data=True)
    assert result.steps == 0 and not out.exists()
    printed = capsys.readouterr().out
    assert printed.count("--- train[") == 3 and "in the loss" in printed


def test_output_dir_rules(tmp_path):
    check_output_dir(tmp_path / "new", force=False)  # absent: fine
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", force=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    with pytest.raises(UserError, match="pass --force"):
        check_output_dir(other, force=False)
    with pytest.raises(UserError, match="not a zfctl run folder"):
        check_output_dir(other, force=True)  # --force never empties a folder zfctl did not make
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        check_output_dir(tmp_path / "file", force=True)


def test_force_clears_only_run_entries(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / "plan.yaml").write_text("train: {}\n")
    (run_dir / "notes.md").write_text("mine")
    check_output_dir(run_dir, force=True)  # a run folder: --force may proceed
    clear_run_dir(run_dir)
    assert [p.name for p in run_dir.iterdir()] == ["notes.md"]
