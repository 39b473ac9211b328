"""What a verb prints is the product: no `error:` for a closed pipe, no line twice.

The cases here are the small defects a new user met in the first hour: ``zfctl ... | head``
ending with ``error: Broken pipe (EPIPE)``, and ``--debug-data`` printing the data summary twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zfctl.cli import app

ROOT = Path(__file__).resolve().parents[2]


def run_into_closed_pipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``zfctl ARGS`` with stdout a pipe whose reader has already gone (``| head`` that has read
    its lines): the first write fails with EPIPE, deterministically."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "zfctl", *args], stdout=write_end, stderr=subprocess.PIPE,
                              check=False, text=True, cwd=cwd, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [
    ["finetune", "--help"],  # the case that broke: Typer's help, written by rich
    ["plan", "tiny-llama", "--data", "alpaca-sample", "--json"],  # print(): the write zfctl makes itself
    ["presets", "ls"],
], ids=["finetune-help", "plan-json", "presets-ls"])
def test_a_closed_pipe_is_no_error(args: list[str], tmp_path: Path) -> None:
    res = run_into_closed_pipe(args, tmp_path)
    assert res.stderr == "", res.stderr  # was: error: Broken pipe (EPIPE), exit 2
    assert res.returncode == 1  # what rich, Typer and Python's docs do when the reader is gone


def test_debug_data_prints_the_data_line_once(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["finetune", "tiny-llama", "--data", "alpaca-sample", "--debug-data",
                                   "--output", str(tmp_path / "r")], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    summary = [line for line in res.output.splitlines() if "train / " in line and "eval sequences" in line]
    assert len(summary) == 1 and summary[0].startswith("data: alpaca-sample: "), summary
    assert "⟦" in res.output  # the samples themselves are still there
    assert not (tmp_path / "r").exists()


def test_bench_loss_under_recompute_does_not_warn_about_the_cache() -> None:
    """`zfctl bench --activation-checkpointing on` printed transformers' "`use_cache=True` is
    incompatible with gradient checkpointing" once per run: a training forward asks for no cache."""
    import logging

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from zfctl.bench.model import _lm_loss
    from zfctl.train.models.load import enable_activation_checkpointing

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=8))
    enable_activation_checkpointing(model)  # what `zfctl bench --activation-checkpointing on` does
    model.train()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    root = hf_logging.get_logger()  # transformers' loggers all propagate to this one
    logging.Logger.warning_once.cache_clear()  # a warning_once shown earlier in this process shows again
    root.addHandler(handler)
    try:
        _lm_loss(model, {"input_ids": torch.randint(0, 64, (1, 8))}).backward()
    finally:
        root.removeHandler(handler)
    assert not [m for m in seen if "use_cache" in m], seen


def test_export_names_the_checkpoint_as_generate_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`exported runs/demo/checkpoints/step-000118 (step 118) -> runs/demo-hf-step118`, as the README
    quotes it and as `generate` names a checkpoint: relative to the current folder, not absolute."""
    import json

    import zfctl.train

    monkeypatch.chdir(tmp_path)
    ckpt = (tmp_path / "runs" / "demo" / "checkpoints" / "step-000118").resolve()

    def fake_export(ckpt_dir, output, *, force=False, push_to_hub=None):
        Path(output).mkdir(parents=True)
        (Path(output) / "zfctl-export.json").write_text(json.dumps({"checkpoint": str(ckpt), "step": 118}))
        return Path(output)

    monkeypatch.setattr(zfctl.train, "export", fake_export)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    res = CliRunner().invoke(app, ["export", "runs/demo", "--output", "runs/demo-hf-step118"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert res.output.strip() == "exported runs/demo/checkpoints/step-000118 (step 118) -> runs/demo-hf-step118"
