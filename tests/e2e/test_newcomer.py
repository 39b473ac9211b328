"""What a new user meets after a first run, as processes in a shell: the commands `finetune` prints
at its end run as printed, `generate` answers in the format the run trained on, and plain
transformers on the export gives the same greedy tokens; resume says when a run is finished and
refuses to re-warm its LR schedule silently.

The run is started as `make demo` starts it, through the environment's `zfctl` script with that
environment's bin folder *not* on PATH, so the printed commands begin with activating it.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zfctl.train.display import STEP_LINE_LEGEND
from zfctl.train.metrics import read_metrics

BIN = Path(sys.prefix) / "bin"
ZFCTL = BIN / "zfctl"
PROMPT = "What is 12 + 7?"
STEPS = 8  # past the warm-ups of 4 (no short-run warning); what the run learns is no claim here
FURTHER = STEPS + STEPS // 4  # the next: block's continuation of a finished cosine run (cli/finetune.py)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ZFCTL.is_file() or sys.prefix == sys.base_prefix,
                                 reason="needs zfctl installed in a virtual environment (make setup)")]


def tree_digest(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes: what "nothing was written" compares."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def shell_env() -> dict[str, str]:
    """This environment minus its bin folder on PATH (as before `source .venv/bin/activate`), and
    no COLUMNS: output is piped, as in a log."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != BIN.resolve())
    return env


def sh(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"umask 022\n{command}"], cwd=cwd, env=shell_env(), text=True, check=False,
                          capture_output=True, timeout=600)


def readme_transformers_snippet() -> str:
    """README.md's python block that loads the demo's export with plain transformers."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (snippet,) = [b for b in blocks if 'AutoTokenizer.from_pretrained("runs/demo-hf-step' in b]
    return snippet


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, list[str], str]:
    """A short demo run in a fresh folder: (folder, the printed next commands, its output)."""
    work = tmp_path_factory.mktemp("newcomer")
    res = sh(f"{ZFCTL} finetune tiny-llama --data alpaca-sample --output runs/demo --max-steps {STEPS} "
             "--set train.warmup_steps=4 --set zenflow.full_warm_up_rounds=4", work)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    start = lines.index("next:")
    return work, [ln.strip() for ln in lines[start + 1:] if ln.strip()], res.stdout + res.stderr


def test_the_run_ends_with_commands_that_run_as_printed(demo) -> None:
    work, commands, output = demo
    activate = f"source {BIN / 'activate'}"
    assert commands == [
        activate,
        f"zfctl generate runs/demo --prompt '{PROMPT}'",
        f"zfctl export runs/demo --output runs/demo-hf-step{STEPS}",
        f"zfctl resume runs/demo --max-steps {FURTHER} --allow-changes",
    ]
    # what that continuation does to the LR, said next to it (stderr: the next: block holds commands only)
    assert (f"note: `zfctl resume --max-steps {FURTHER} --allow-changes` stretches the cosine LR schedule to end at "
            f"step {FURTHER}: the LR, ~0 at the end of this run, restarts at ") in output, output
    before = tree_digest(work / "runs" / "demo")
    # without --allow-changes the longer schedule is refused: the LR would jump, nothing is written
    res = sh(f"{activate}\nzfctl resume runs/demo --max-steps {2 * STEPS}", work)
    assert res.returncode == 2, res.stdout + res.stderr
    assert (f"error: --max-steps {2 * STEPS} moves the end of the cosine LR schedule from step {STEPS}: step "
            f"{STEPS + 1} would train at lr ") in res.stderr and "instead of 0," in res.stderr
    assert tree_digest(work / "runs" / "demo") == before
    outputs = {}
    for command in commands[1:]:
        res = sh(f"{activate}\n{command}", work)
        assert res.returncode == 0, f"{command}\n{res.stdout}{res.stderr}"
        outputs[command.split()[1]] = res
    assert [r["step"] for r in read_metrics(work / "runs" / "demo" / "metrics.jsonl", "train")][-1] == FURTHER
    resumed = outputs["resume"].stdout.splitlines()  # resume ends as finetune does: losses, then next:
    assert any(ln.startswith(f"done {FURTHER} steps  train loss (last step) ") for ln in resumed), resumed
    assert "next:" in resumed, resumed
    exported = outputs["export"].stdout + outputs["export"].stderr
    assert exported.strip() == (f"exported runs/demo/checkpoints/step-{STEPS:06d} (step {STEPS}) -> "
                                f"runs/demo-hf-step{STEPS}")
    modes = {f.name: f.stat().st_mode & 0o777 for f in (work / "runs" / f"demo-hf-step{STEPS}").iterdir()}
    assert set(modes.values()) == {0o644}, modes  # safetensors' own 0600 included
    # a finished run says so, and loads nothing
    res = sh(f"{activate}\nzfctl resume runs/demo", work)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith(f"finished: runs/demo ended at step {FURTHER} (")
    assert "resuming from" not in res.stdout and "eval loss" not in res.stdout


def test_generate_matches_plain_transformers_on_the_export(demo, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zfctl.train.generate import load_generator

    work, _, _ = demo
    out = tmp_path / "hf"
    # by the CLI in its own process, as a user runs it
    res = sh(f"{ZFCTL} export runs/demo/checkpoints/step-{STEPS:06d} --output {out}", work)
    assert res.returncode == 0, res.stdout + res.stderr
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert tok.decode(ids) == f"<s>### Instruction:\n{PROMPT}\n\n### Response:\n"  # alpaca, not ChatML
    ids = torch.tensor([ids])
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                           pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    gen = load_generator(work / "runs" / "demo" / "checkpoints" / f"step-{STEPS:06d}", torch.device("cpu"), [])
    assert gen.prompt_ids([{"role": "user", "content": PROMPT}]) == ids[0].tolist()  # the run's own format
    mine = gen.generate([{"role": "user", "content": PROMPT}], max_new_tokens=32, temperature=0.0)
    # The same greedy tokens. The 5.3M demo model answers noise, an immediate EOS as likely as not
    # (which tokens depends on every bit of training), so the next-token distribution is compared
    # too: the whole of it, which an immediate EOS alone would not show.
    assert mine == plain
    with torch.no_grad():
        assert torch.equal(gen.model(ids).logits, model(ids).logits)
    # the CLI streams the same text, from the run folder's checkpoint and from the export
    answer = tok.decode(plain, skip_special_tokens=True)
    # the README's plain-transformers snippet, as printed there, on this export
    snippet = re.sub(r'"runs/demo-hf-step\d+"', lambda _: repr(str(out)), readme_transformers_snippet())
    res = subprocess.run([sys.executable, "-c", snippet], cwd=work, capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.removesuffix("\n") == answer
    for source in (f"runs/demo/checkpoints/step-{STEPS:06d}", str(out)):
        res = sh(f"{ZFCTL} generate {source} --prompt '{PROMPT}' --max-new-tokens 32", work)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.splitlines()[1:] == [answer], res.stdout


def test_the_step_line_is_explained_once(demo) -> None:
    _, _, output = demo
    assert output.count(STEP_LINE_LEGEND) == 1
    assert output.index(STEP_LINE_LEGEND) < output.index(f"step 1/{STEPS} | loss")
    assert "warning: train.max_steps" not in output  # the warm-ups fit this run: no short-run warning


def test_chat_asks_at_a_terminal_and_ends_at_eof(demo) -> None:
    work, _, _ = demo
    leader, follower = pty.openpty()
    p = subprocess.Popen([str(ZFCTL), "generate", f"runs/demo/checkpoints/step-{STEPS:06d}", "--chat",
                          "--max-new-tokens", "8"], cwd=work, env=shell_env(), stdin=follower,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(follower)
    os.write(leader, f"{PROMPT}\n".encode())  # the terminal holds it until generate reads it
    os.write(leader, b"\x04")  # Ctrl-D on an empty line: end of input
    out, err = p.communicate(timeout=120)
    os.close(leader)
    assert p.returncode == 0, out + err
    lines = out.splitlines()
    assert lines[0] == f"model: runs/demo/checkpoints/step-{STEPS:06d} (step {STEPS})", out
    # input() writes its prompt to stdout: one question, one answer (the demo model's noise, which
    # may be an immediate EOS: an empty one), then the prompt that saw EOF
    assert len(lines) == 3 and lines[1].startswith(">>> ") and lines[2] == ">>> ", out
