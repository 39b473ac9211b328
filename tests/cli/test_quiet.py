"""Quiet by default: torchrun's OMP_NUM_THREADS banner, transformers' loading bars and
the 80-line plan are hidden unless --verbose (zfctl/quiet.py, zfctl/plan/brief.py)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.quiet import VERBOSE_ENV, torchrun_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("given", "passed"), [(None, "1"), ("", "1"), ("  ", "1"), ("4", "4")])
def test_torchrun_gets_the_threads_it_would_set_and_never_an_empty_value(given: str | None, passed: str) -> None:
    env = {} if given is None else {"OMP_NUM_THREADS": given}
    assert torchrun_env(env)["OMP_NUM_THREADS"] == passed


def test_relaunch_sets_omp_threads_so_torchrun_prints_no_banner(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun prints its 4-line banner exactly when OMP_NUM_THREADS is missing from the
    environment it gets (torch/distributed/run.py); the launcher now always passes a value."""
    from zfctl.train import dist

    seen: list[dict] = []

    class Done:
        pid = 0

        def __init__(self, cmd: list[str], env: dict, **kw: object) -> None:
            seen.append(env)

        def wait(self) -> int:
            return 0

        def poll(self) -> int:
            return 0

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(dist.subprocess, "Popen", Done)
    assert dist.relaunch(2, ["finetune", "tiny-llama"]) == 0
    assert seen[0]["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # exported empty: libgomp would reject it in every rank
    dist.relaunch(2, ["finetune", "tiny-llama"])
    assert seen[1]["OMP_NUM_THREADS"] == "1"


def test_the_padded_plan_table_has_no_trailing_spaces_off_a_terminal() -> None:
    """rich pads each table row to the table's width; in a log file that was 120 columns of spaces."""
    from zfctl.cli._common import UnpaddedConsole
    from zfctl.plan import resolve_plan
    from zfctl.plan.render import print_plan

    out = io.StringIO()
    print_plan(resolve_plan("tiny-llama", "alpaca-sample"), UnpaddedConsole(file=out, width=200))
    lines = out.getvalue().splitlines()
    assert len(lines) > 60 and "run plan" in lines[0]
    assert [line for line in lines if line != line.rstrip()] == []


def test_plan_output_to_a_file_is_not_padded() -> None:
    res = CliRunner().invoke(app, ["plan", "tiny-llama", "--data", "alpaca-sample"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    padded = [line for line in res.output.splitlines() if line != line.rstrip()]
    assert padded == [], padded[:3]


def test_finetune_prints_a_short_plan_unless_verbose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan before the first step line: its main keys, not 80 lines; --verbose prints them all."""
    monkeypatch.setenv(VERBOSE_ENV, "0")  # restored after the test: --verbose below sets it
    monkeypatch.setattr("zfctl.train.session.run", lambda plan, **kw: (_ for _ in ()).throw(SystemExit(0)))
    args = ["finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(tmp_path / "r")]

    def plan_lines(extra: list[str]) -> list[str]:
        res = CliRunner().invoke(app, args + extra, env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith("run plan"))
        end = next(i for i, line in enumerate(lines) if line.startswith("memory:"))
        return lines[first:end]

    short = plan_lines([])
    assert len(short) <= 8, short
    text = "\n".join(short)
    for key in ("name=tiny-llama", "name=alpaca-sample", "lr=0.003", "topk_ratio=0.1", "update_interval=4",
                f"output_dir={tmp_path / 'r'}"):
        assert key in text, (key, text)
    full = plan_lines(["--verbose"])
    assert len(full) > 60 and any(line.split() == ["ring_slots", "4"] for line in full), full[:5]


@pytest.mark.slow
def test_loading_bars_only_with_verbose(tmp_path: Path) -> None:
    """A model loaded with from_pretrained (a local folder here, a hub model or smollm2-135m for a
    user) drew transformers' "Loading weights" bar on stderr in finetune and generate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zfctl.train.models.load import embedded_tokenizer_dir

    local = tmp_path / "local"
    LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=128)).save_pretrained(local)
    for f in Path(embedded_tokenizer_dir()).iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE",
                                                                 VERBOSE_ENV)}
    env["PYTHONPATH"] = str(ROOT)

    def zfctl(*args: str) -> str:
        p = subprocess.run([sys.executable, "-m", "zfctl", *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600, check=False)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stderr

    run = str(tmp_path / "run")
    err = zfctl("finetune", str(local), "--data", "alpaca-sample", "--output", run, "--max-steps", "1",
                "--set", "zenflow.full_warm_up_rounds=0", "--set", "train.warmup_steps=0")
    assert "Loading weights" not in err and "%|" not in err, err
    err = zfctl("generate", run, "--prompt", "What is 12 + 7?", "--max-new-tokens", "2")
    assert "Loading weights" not in err and "%|" not in err, err
    err = zfctl("generate", run, "--prompt", "What is 12 + 7?", "--max-new-tokens", "2", "--verbose")
    assert "Loading weights" in err  # the flag gives the bars back
