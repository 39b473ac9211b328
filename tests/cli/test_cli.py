"""The real CLI (Typer app in-process, plus `python -m zfctl` in a subprocess): verbs, bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import widen_consoles
from typer.testing import CliRunner

import zfctl.train
from zfctl.cli import app
from zfctl.plan import machine
from zfctl.train import session

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rich wraps table cells at 80 columns; tests read whole phrases."""
    widen_consoles(monkeypatch)


@pytest.fixture
def small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """This project's CI machine: 24 GB RAM, no GPU (independent of where the test runs)."""
    monkeypatch.setattr(machine, "this_machine", lambda: machine.Machine(host_ram=24 * machine.GB, cuda=False))


def zf(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_help_lists_every_verb() -> None:
    result = zf("--help")
    assert result.exit_code == 0
    for verb in ("finetune", "resume", "bench", "plan", "presets", "export", "generate", "doctor"):
        assert verb in result.output


def test_presets_ls_shows_every_preset_with_a_description() -> None:
    result = zf("presets", "ls")
    assert result.exit_code == 0
    for name in (
        "llama2-7b",
        "llama2-13b",
        "llama3.2-1b",
        "opt-350m",
        "gpt2",
        "tiny-llama",
        "alpaca",
        "glue-sst2",
        "arxiv-abstract",
        "alpaca-sample",
        "sst2-sample",
        "default",
        "aggressive",
        "zero-offload",
        "off",
    ):
        assert f" {name} " in result.output
    assert "plain ZeRO-Offload baseline" in result.output


def test_presets_show_prints_file_and_key_help() -> None:
    result = zf("presets", "show", "zero-offload")
    assert result.exit_code == 0
    assert "topk_ratio: 0.0" in result.output and "zenflow.update_interval" in result.output
    assert "Fraction of the columns of every 2-D weight" in result.output
    section = zf("presets", "show", "train")
    assert section.exit_code == 0 and "train.gradient_accumulation_steps" in section.output


def test_presets_cp_then_use_as_config(tmp_path: Path) -> None:
    assert zf("presets", "cp", "aggressive", tmp_path).exit_code == 0
    copied = tmp_path / "aggressive.yaml"
    assert copied.read_text() == (ROOT / "presets" / "zenflow" / "aggressive.yaml").read_text()
    again = zf("presets", "cp", "aggressive", tmp_path)
    assert again.exit_code == 2 and "already exists" in again.stderr
    copied.write_text(copied.read_text().replace("update_interval: 8", "update_interval: 6"))
    result = zf("plan", "tiny-llama", "--data", "alpaca-sample", "--config", copied, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["zenflow"]["update_interval"] == 6


def test_plan_llama2_7b_says_this_machine_cannot_run_it(small_machine: None) -> None:
    result = zf("plan", "llama2-7b", "--data", "alpaca")
    assert result.exit_code == 3, result.output  # zfctl/cli/plan.py DOES_NOT_FIT
    out = result.output
    assert "meta-llama/Llama-2-7b-hf" in out and "tatsu-lab/alpaca" in out  # the plan
    assert "53.9 GB" in out  # host: fp32 moments, 8 B per matrix element
    assert "13.5 GB" in out  # device: bf16 weights
    assert "it does not fit" in out and "host RAM" in out and "(largest: fp32 moments" in out


def test_plan_json_is_machine_readable(small_machine: None) -> None:
    result = zf("plan", "tiny-llama", "--data", "sst2-sample", "--zenflow", "off", "--set", "train.lr=1e-3")
    assert result.exit_code == 0
    data = json.loads(
        zf(
            "plan",
            "tiny-llama",
            "--data",
            "sst2-sample",
            "--zenflow",
            "off",
            "--set",
            "train.lr=1e-3",
            "--json",
        ).stdout
    )
    assert data["plan"]["train"]["lr"] == 1e-3 and data["plan"]["zenflow"]["topk_ratio"] == 1.0
    assert data["memory"]["fits"] is True and data["memory"]["size"]["params"] == 5_261_568


def _bad_json(tmp: Path) -> Path:
    p = tmp / "ds.json"
    p.write_text('{"zero_optimization": {"stage": 2,}\n')
    return p


def _bad_yaml(tmp: Path) -> Path:
    p = tmp / "plan.yaml"
    p.write_text("train:\n  lr: [1e-4\n")
    return p


def _ds(tmp: Path, cfg: dict) -> Path:
    p = tmp / "ds_config.json"
    p.write_text(json.dumps(cfg))
    return p


BAD_INPUTS = [
    # (what, extra args after `plan tiny-llama --data alpaca-sample`, text the error line must hold)
    (
        "unknown key with typo",
        ["--set", "zenflow.topk_ration=0.2"],
        "zenflow.topk_ration=0.2: unknown key (did you mean zenflow.topk_ratio?)",
    ),
    ("out-of-range ratio", ["--set", "zenflow.topk_ratio=1.5"], "zenflow.topk_ratio=1.5"),
    ("bad interval", ["--set", "zenflow.update_interval=0"], "zenflow.update_interval=0"),
    ("interval not a number", ["--set", "zenflow.update_interval=often"], "zenflow.update_interval='often'"),
    (
        "select < update interval",
        ["--set", "zenflow.select_interval=2"],
        "zenflow.select_interval=2",
    ),
    ("malformed --set", ["--set", "train.lr"], "--set='train.lr'"),
    ("wrong type", ["--set", "train.micro_batch_size=two"], "train.micro_batch_size='two'"),
    ("unknown section", ["--set", "trian.lr=1e-4"], "did you mean train"),
    ("unknown zenflow preset", ["--zenflow", "agressive"], "--zenflow='agressive'"),
    ("malformed JSON", ["--config", _bad_json], "malformed JSON at line 1"),
    ("malformed YAML", ["--config", _bad_yaml], "malformed YAML"),
    (
        "conflicting precision",
        ["--config", lambda t: _ds(t, {"bf16": {"enabled": True}, "fp16": {"enabled": True}})],
        "bf16.enabled=True",
    ),
    (
        "unsupported DeepSpeed key",
        ["--config", lambda t: _ds(t, {"zero_optimization": {"stage": 3}})],
        "zero_optimization.stage=3",
    ),
    (
        "DeepSpeed key typo",
        ["--config", lambda t: _ds(t, {"gradient_clipings": 1.0})],
        "did you mean gradient_clipping",
    ),
    ("missing config file", ["--config", lambda t: t / "nope.yaml"], "nope.yaml: file not found"),
]


@pytest.mark.parametrize("what, extra, needle", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, what: str, extra: list, needle: str) -> None:
    args = [a(tmp_path) if callable(a) else a for a in extra]
    for verb in ("plan", "finetune"):
        result = zf(verb, "tiny-llama", "--data", "alpaca-sample", *args, "--output", tmp_path / "run")
        assert result.exit_code == 2, (what, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert needle in lines[0], lines[0]
        assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["plan", "llama2-7", "--data", "alpaca"],
            "MODEL='llama2-7': not a model preset (did you mean llama2-7b?)",
        ),
        (["plan", "tiny-llama", "--data", "missing.jsonl"], "--data='missing.jsonl': file not found"),
        (["plan", "tiny-llama", "--data", "alpacca"], "did you mean alpaca?"),
        (["presets", "show", "tiny-lama"], "NAME='tiny-lama'"),
        (["presets", "cp", "default", "x.yaml", "--kind", "modell"], "--kind='modell'"),
    ],
)
def test_bad_names_are_one_line_exit_2(args: list[str], needle: str) -> None:
    result = zf(*args)
    assert result.exit_code == 2 and needle in result.stderr and "Traceback" not in result.output


def test_click_usage_errors_also_exit_2(tmp_path: Path) -> None:
    assert zf("plan", "tiny-llama").exit_code == 2  # --data missing
    assert zf("finetune", "tiny-llama", "--data", "alpaca-sample", "--max-steps", "0").exit_code == 2
    assert zf("resume", tmp_path / "no-such-run").exit_code == 2


def test_finetune_passes_the_resolved_plan_to_the_loop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = []

    class Result:
        output_dir, steps, final_train_loss, final_eval_loss, last_checkpoint = tmp_path, 3, 2.5, 2.75, None

    def fake_run(plan, *, force=False, debug_data=False):
        calls.append((plan, force, debug_data))
        return Result()

    monkeypatch.setattr(session, "run", fake_run)
    result = zf(
        "finetune",
        "tiny-llama",
        "--data",
        "alpaca-sample",
        "--zenflow",
        "zero-offload",
        "--set",
        "train.lr=1e-3",
        "--output",
        tmp_path / "out",
        "--max-steps",
        "3",
        "--force",
    )
    assert result.exit_code == 0, result.output
    ((plan, force, debug_data),) = calls
    assert (plan.checkpoint.output_dir, plan.train.max_steps, plan.train.lr) == (
        str(tmp_path / "out"),
        3,
        1e-3,
    )
    assert (plan.zenflow.topk_ratio, plan.zenflow.update_interval, force, debug_data) == (0.0, 1, True, False)
    assert "run plan" in result.output and "2.5000" in result.output


def test_doctor_reports_without_crashing_when_pieces_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    ok = zf("doctor")
    assert ok.exit_code == 0
    for row in ("torch", "CUDA", "native CPU-Adam", "CPU ISA", "cores", "host memory", "pinned memory"):
        assert row in ok.output
    monkeypatch.setitem(sys.modules, "zfctl._native", None)  # import of it now raises ImportError
    broken = zf("doctor")
    assert broken.exit_code == 0 and "native CPU-Adam binding missing" in broken.output


@pytest.mark.slow
def test_python_m_zfctl_exit_code_and_single_stderr_line() -> None:
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "zfctl",
            "plan",
            "tiny-llama",
            "--data",
            "alpaca-sample",
            "--set",
            "zenflow.topk_ratio=2",
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: zenflow.topk_ratio=2.0: must be a number in [0, 1], e.g. 0.1"


def test_resume_and_export_call_the_engine_with_the_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from zfctl.plan import resolve_plan

    seen: dict = {}

    class Result:
        output_dir, steps, already_finished, last_checkpoint = tmp_path, 7, False, None

    def fake_resume(ckpt_dir, *, max_steps=None, allow_changes=False, on_plan=None, latest_good=False,
                    strategy=None):
        seen["resume"] = (Path(ckpt_dir), max_steps, allow_changes, latest_good, strategy)
        on_plan(resolve_plan("tiny-llama", "sst2-sample"))  # the loop hands the saved plan back
        return Result()

    def fake_export(ckpt_dir, output, *, force=False, push_to_hub=None):
        seen["export"] = (Path(ckpt_dir), Path(output), force, push_to_hub)
        Path(output).mkdir()
        (Path(output) / "zfctl-export.json").write_text(json.dumps({"checkpoint": "ck", "step": 7}))
        return Path(output)

    monkeypatch.setattr(session, "resume", fake_resume)
    monkeypatch.setattr(zfctl.train, "export", fake_export)
    res = zf("resume", tmp_path, "--max-steps", "7", "--allow-changes")
    assert res.exit_code == 0, res.output
    assert seen["resume"] == (tmp_path, 7, True, False, None)
    assert "sst2-sample" in res.output and "done 7 steps" in res.output  # plan printed via on_plan
    assert zf("resume", tmp_path, "--latest-good").exit_code == 0 and seen["resume"][3] is True
    assert zf("resume", tmp_path, "--strategy", "fsdp").exit_code == 0 and seen["resume"][4] == "fsdp"
    exp = zf("export", tmp_path, "--output", tmp_path / "hf", "--force", "--push-to-hub", "me/tiny")
    assert exp.exit_code == 0, exp.output
    assert seen["export"] == (tmp_path, tmp_path / "hf", True, "me/tiny")
    assert f"exported ck (step 7) -> {tmp_path / 'hf'}" in exp.output  # which checkpoint it wrote


def test_finetune_warns_once_about_settings_that_lose_accuracy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Result:
        output_dir, steps, final_train_loss, final_eval_loss, last_checkpoint = tmp_path, 1, 1.0, 1.0, None

    monkeypatch.setattr(session, "run", lambda plan, **kw: Result())
    base = ["finetune", "tiny-llama", "--data", "alpaca-sample", "--output", tmp_path / "o", "--force"]
    # tiny-llama is random init: the paper's settings hit every rule, each warned exactly once.
    paper = zf(*base, "--zenflow", "paper")
    assert paper.exit_code == 0, paper.output
    for needle in ("full_warm_up_rounds=0: the first steps on random init", "deferred_lr_scale=off",
                   "select_interval=auto", "vocab_select=columns"):
        assert paper.stderr.count(needle) == 1, paper.stderr
    # The rules are about the settings, not the preset's name: fixing each one silences it.
    fixed = zf(*base, "--zenflow", "paper", "--set", "zenflow.full_warm_up_rounds=10",
               "--set", "zenflow.deferred_lr_scale=sqrt", "--set", "zenflow.select_interval=32",
               "--set", "zenflow.vocab_select=rows")
    assert fixed.exit_code == 0 and "warning" not in fixed.stderr, fixed.stderr
    assert "warning" not in zf(*base).stderr  # the default preset
    # A scaled CPU step without the warm-up: measured worse than no correction at all.
    hot = zf(*base, "--set", "zenflow.full_warm_up_rounds=0")
    assert hot.stderr.count("warning") == 1 and "makes it worse" in hot.stderr, hot.stderr
    for exact in ("off", "zero-offload"):  # AdamW exactly: nothing to warn about
        assert "warning" not in zf(*base, "--zenflow", exact).stderr
