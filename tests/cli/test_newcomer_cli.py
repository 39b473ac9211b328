"""The small things a new user meets first, through the real CLI: flags without a `<bool>`
placeholder, piped output that does not wrap at 80 columns, the step line explained, warnings for
runs shorter than their warm-ups, `generate`'s flags, and what `resume --max-steps` may change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import UserError
from zfctl.plan.advice import short_run_warnings
from zfctl.plan.resolve import resolve_plan
from zfctl.train import session
from zfctl.train.display import STEP_LINE_LEGEND, format_train_line
from zfctl.train.run_length import check_new_length, planned_steps

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
VERBS = ("finetune", "resume", "bench", "plan", "export", "generate", "doctor")


def test_boolean_flags_show_no_value_placeholder() -> None:
    pages = [runner.invoke(app, ["--help"]), runner.invoke(app, ["presets", "cp", "--help"]),
             *(runner.invoke(app, [verb, "--help"]) for verb in VERBS)]
    for page in pages:
        assert page.exit_code == 0, page.output
        assert "<bool>" not in page.output, page.output
    finetune = runner.invoke(app, ["finetune", "--help"], env={"COLUMNS": "200"}).output
    assert "--force" in finetune and "<int range>" in finetune  # the other types are still shown


def test_piped_output_is_not_wrapped_at_80_columns() -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    res = subprocess.run([sys.executable, "-m", "zfctl", "plan", "tiny-llama", "--data", "alpaca-sample", "--verbose"],
                         check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    description = "5.3M-param Llama, random init + embedded tokenizer; the offline default (CPU, minutes)"
    assert any(line.strip() == f"description                  {description}" for line in res.stdout.splitlines())


def test_the_step_line_legend_names_every_field() -> None:
    rec = {"step": 40, "loss": 3.41, "loss_steps": 10, "lr": 2e-4, "tokens_per_s": 5300, "step_ms": 182,
           "compute_ms": 150, "device_opt_ms": 20, "stall_ms": 12, "gpu_busy": 0.93, "cpu_step_ms": 30,
           "selected_fraction": 0.1, "select_stay": 0.6, "grad_norm": 2.5, "host_peak_gib": 1.2,
           "device_peak_gib": 3.0}
    line = format_train_line(rec, 200)
    fields = ["loss", "(avg N)", "lr", "tok/s", "ms", "fwd/bwd", "opt", "stall", "busy", "cpu-adam", "sel",
              "stay", "gnorm", "host/dev"]
    for name in fields[:1] + fields[2:-1]:
        assert name in line  # the legend explains what the line shows
    for name in ("loss", "lr", "tok/s", "busy", "cpu-adam", "sel", "stay", "gnorm", "host/dev"):
        assert f"{name} = " in STEP_LINE_LEGEND, name  # each one defined
    helptext = runner.invoke(app, ["finetune", "--help"], env={"COLUMNS": "400"}).output
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in fields:
        assert name in STEP_LINE_LEGEND, name
        assert name in helptext, name
        assert f"`{name}`" in readme, name


def test_runs_shorter_than_their_warm_ups_are_warned_about() -> None:
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.max_steps=10"])
    assert short_run_warnings(plan) == [
        ("train.max_steps=10 is within zenflow.full_warm_up_rounds=20: every step of this run is a synchronous "
         "full CPU-offload step (the CPU AdamW updates every weight matrix and the step waits; the step line's "
         "`sel 0.00`) and ZenFlow's overlapped split never engages; --set zenflow.full_warm_up_rounds=2 to try "
         "ZenFlow in a short run"),
        ("train.max_steps=10 is within train.warmup_steps=20: the learning rate never reaches train.lr=0.003; "
         "--set train.warmup_steps=1 for a short run")]
    fixed = resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        "train.max_steps=10", "train.warmup_steps=1", "zenflow.full_warm_up_rounds=2"])
    assert short_run_warnings(fixed) == []
    off = resolve_plan("tiny-llama", "alpaca-sample", zenflow="off", overrides=["train.max_steps=10"])
    assert [w.split(":")[0] for w in short_run_warnings(off)] == [
        "train.max_steps=10 is within train.warmup_steps=20"]  # no ZenFlow to engage


def test_the_warm_up_is_described_one_way_everywhere() -> None:
    """Defect 5: the library example (docs/library.md), the README's step-line table, scripts/library_example.py, the
    short-run warning, the step-line legend, the default preset and the field's help said "plain
    AdamW on the device" where the code runs synchronous full CPU-offload steps (metrics.jsonl:
    cpu-adam every warm-up step, the whole model's bytes both ways)."""
    from zfctl.offload.config import ZenFlowConfig

    true = "synchronous full CPU-offload step"
    texts = {
        "README.md": (ROOT / "README.md").read_text(encoding="utf-8"),
        "docs/library.md": (ROOT / "docs" / "library.md").read_text(encoding="utf-8"),
        "scripts/library_example.py": (ROOT / "scripts" / "library_example.py").read_text(encoding="utf-8"),
        "presets/zenflow/default.yaml": (ROOT / "presets" / "zenflow" / "default.yaml").read_text(encoding="utf-8"),
        "the short-run warning": short_run_warnings(resolve_plan("tiny-llama", "alpaca-sample",
                                                                 overrides=["train.max_steps=10"]))[0],
        "the step-line legend": STEP_LINE_LEGEND,
        "zenflow.full_warm_up_rounds' help": ZenFlowConfig.__dataclass_fields__["full_warm_up_rounds"].metadata["help"],
    }
    for where, text in texts.items():
        assert true in text, where
        assert "plain AdamW on the device" not in text and "every step is plain AdamW" not in text, where
    assert texts["README.md"].count(true) >= 2  # the step-line table, Short runs


def test_finetune_prints_the_short_run_warnings_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Result:
        output_dir, steps, final_train_loss, final_eval_loss, last_checkpoint = tmp_path, 1, 1.0, 1.0, None

    monkeypatch.setattr(session, "run", lambda plan, **kw: Result())
    res = runner.invoke(app, ["finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(tmp_path / "o"),
                              "--max-steps", "10"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert res.stderr.count("is within zenflow.full_warm_up_rounds=20") == 1
    assert res.stderr.count("is within train.warmup_steps=20") == 1


@pytest.mark.parametrize(("args", "message"), [
    ([], "give one of --prompt TEXT, --prompts FILE, or --chat"),
    (["--prompt", "hi", "--chat"], "give one of --prompt TEXT, --prompts FILE, or --chat"),
    (["--chat"], "--chat needs a terminal on stdin"),
    (["--prompt", " "], "--prompt is empty"),
])
def test_generate_flags_are_checked_first(tmp_path: Path, args: list[str], message: str) -> None:
    res = runner.invoke(app, ["generate", str(tmp_path), *args])
    assert res.exit_code == 2, res.output
    assert res.output.count("error:") == 1 and message in res.output


def _saved(schedule: str, steps: int, warmup: int = 20):
    plan = resolve_plan("tiny-llama", "alpaca-sample",
                        overrides=[f"train.max_steps={steps}", f"train.schedule={schedule}", f"train.warmup_steps={warmup}"])
    return plan


def test_resume_max_steps_refuses_an_lr_change_and_allows_what_keeps_it() -> None:
    four = SimpleNamespace(step=4, world_size=1)
    # every step still to run stays inside the LR warm-up, which does not depend on the length
    assert check_new_length(four, _saved("cosine", 4), 6, allow_changes=False) is None
    with pytest.raises(UserError, match=r"^--max-steps 30 moves the end of the cosine LR schedule from step 4: "
                                        r"step 22 would train at lr 0\.00293 instead of 0, .*--allow-changes"):
        check_new_length(four, _saved("cosine", 4), 30, allow_changes=False)
    note = check_new_length(four, _saved("linear", 4), 30, allow_changes=True)
    assert note is not None and note.endswith("(--allow-changes)") and "linear" in note
    assert check_new_length(four, _saved("constant", 4), 300, allow_changes=False) is None
    # a finished 118-step demo resumed to 236 steps would re-warm from ~0 (README, resume --max-steps)
    done = SimpleNamespace(step=118, world_size=1)
    with pytest.raises(UserError, match="step 119 would train at lr 0.00[0-9]+ instead of 0,"):
        check_new_length(done, _saved("cosine", 118), 236, allow_changes=False)


def test_planned_steps_counts_like_the_training_loop() -> None:
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.epochs=2"])
    # 1880 records, micro-batch 16: 118 micro-batches an epoch (the last one short) on one process
    assert planned_steps(plan.train, 1880, 1) == 236
    assert planned_steps(plan.train, 1880, 2) == 2 * (1880 // 32)  # the ragged end is dropped on 2


def test_next_commands_ask_for_allow_changes_only_where_the_lr_would_change(monkeypatch) -> None:
    from zfctl.cli import finetune

    monkeypatch.setattr(finetune, "activate_command", lambda: None)  # zfctl on PATH is this one
    inside = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.max_steps=6"])  # warm-up: 20 steps
    assert finetune.next_commands(inside, Path("runs/x"), 6) == [
        "zfctl generate runs/x --prompt 'What is 12 + 7?'", "zfctl export runs/x --output runs/x-hf-step6",
        "zfctl resume runs/x --max-steps 12"]
    past = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.max_steps=40", "train.warmup_steps=4"])
    assert finetune.next_commands(past, Path("my runs/x"), 40)[-1] == (
        "zfctl resume 'my runs/x' --max-steps 50 --allow-changes")  # quoted for the shell


def test_the_next_block_trains_further_gently_and_says_what_it_does_to_the_lr(monkeypatch) -> None:
    """A finished cosine run's LR is ~0: doubling it would restart at half of train.lr (a 30-step
    run's eval loss went 3.46 -> 4.92 that way); a quarter more restarts near a tenth, and the note
    says so. A chat run is tried with --chat, not with an alpaca question."""
    from zfctl.cli import finetune

    monkeypatch.setattr(finetune, "activate_command", lambda: None)
    run = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.max_steps=30", "train.warmup_steps=2"])
    assert finetune.next_commands(run, Path("r"), 30)[-1] == "zfctl resume r --max-steps 37 --allow-changes"
    note = finetune.further_lr_note(run.train, 30)
    assert note.startswith("`zfctl resume --max-steps 37 --allow-changes` stretches the cosine LR schedule to end "
                           "at step 37: the LR, ~0 at the end of this run, restarts at 0.000286 at step 31 (10% of "
                           "train.lr 0.003)"), note
    flat = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.max_steps=30", "train.schedule=constant"])
    assert finetune.next_commands(flat, Path("r"), 30)[-1] == "zfctl resume r --max-steps 60"
    assert "continues the same LR schedule (constant" in finetune.further_lr_note(flat.train, 30)
    chat = resolve_plan("tiny-llama", "chat-sample", overrides=["train.max_steps=30"])
    assert finetune.next_commands(chat, Path("r"), 30)[0] == "zfctl generate r --chat"


def test_an_interactive_chat_keeps_the_conversation_and_other_templates_do_not() -> None:
    """Generator.reply: a chat run's second turn is rendered after the first exchange; an alpaca
    run's is rendered alone, as it trained (one exchange per sequence)."""
    import torch

    from zfctl.train.generate import Generator

    class Tok:
        eos_token_id = 2

        def __init__(self) -> None:
            self.seen: list[list[str]] = []

        def apply_chat_template(self, messages, **kw):
            self.seen.append([m["content"] for m in messages])
            return [1, 5]

        def decode(self, ids, skip_special_tokens=True):
            return "answer"

    class Model:
        device = torch.device("cpu")
        config = None

        def generate(self, ids, **kw):
            return torch.tensor([[*ids[0].tolist(), 7, 2]])

    for multi_turn, second in ((True, ["one", "answer", "two"]), (False, ["two"])):
        tok = Tok()
        gen = Generator(Model(), tok, "m", multi_turn=multi_turn)
        assert gen.reply("one", max_new_tokens=4, temperature=0.0) == "answer"
        gen.reply("two", max_new_tokens=4, temperature=0.0)
        assert tok.seen == [["one"], second]
