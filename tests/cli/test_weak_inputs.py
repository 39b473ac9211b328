"""Bad inputs whose line used to mislead or name no fix, and one defect
(`generate` on an export without its tokenizer): each is now one `error:` line naming the problem
and the fix, exit 2, no traceback, nothing written.

`plan`, `finetune`, `resume` and `generate` run in-process (the Typer app) where their output is
zfctl's own; the long prompt runs as a process, since transformers' logger writes to the stderr
it found at import. The runs that `resume` and `generate` need are tiny (2 steps, in-process).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import widen_consoles
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.plan.resolve import resolve_plan
from zfctl.train import export, run

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4", "data.max_length=64",
    "train.micro_batch_size=4", "train.eval_every=0", "train.device=cpu", "train.precision=fp32",
    "train.max_steps=2", "zenflow.full_warm_up_rounds=0",
]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch)


def zf(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes: what "nothing written" compares."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def one_error(result, needle: str) -> str:
    """The refusal's one line (exit 2, no traceback, no plan), holding ``needle``."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert "Traceback" not in result.output and "run plan" not in result.stdout, result.output
    return lines[0]


def tiny_run(out: Path, data: str = "alpaca-sample", *extra: str) -> Path:
    run(resolve_plan("tiny-llama", data, overrides=[*TINY, f"checkpoint.output_dir={out}", *extra]))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("weak") / "run", "alpaca-sample", "data.end_idx=64")


def test_an_unknown_model_config_key_is_refused_before_the_plan_with_the_fix(tmp_path: Path) -> None:
    """finetune refuses it in its pre-flight (zfctl plan, a light verb, never loads transformers)."""
    line = one_error(zf("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", tmp_path / "run",
                        "--set", "model.config.bogus_key=1"), "model.config.bogus_key=1: unknown key")
    assert "remove --set model.config.bogus_key" in line, line
    near = one_error(zf("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", tmp_path / "run",
                        "--set", "model.config.hiden_size=8"), "model.config.hiden_size=8: unknown key")
    assert "did you mean model.config.hidden_size?" in near, near
    assert not (tmp_path / "run").exists()


def test_a_micro_batch_larger_than_the_data_is_refused_at_once_and_never_fitted(tmp_path: Path) -> None:
    """1e8 sequences per micro-batch for 1,880 records: the plan would size activations and host
    memory for 1e8 and --fit advise micro_batch_size=2000 x 50000 accumulation; refused in the
    pre-flight instead, before the plan, in seconds (not the 683 s the run took)."""
    needle = ("train.micro_batch_size=100000000: one micro-batch is more than the 1,880 training records of "
              "alpaca-sample; use at most 1,880")
    for args in (["plan"], ["plan", "--fit"], ["finetune", "--output", tmp_path / "run"],
                 ["finetune", "--fit", "--output", tmp_path / "run"]):
        start = time.monotonic()
        one_error(zf(args[0], "tiny-llama", "--data", "alpaca-sample", *args[1:], "--set",
                     "train.micro_batch_size=100000000"), needle)
        assert time.monotonic() - start < 60  # a loaded box: the point is "no training", not a timing
    # on several processes the line counts per process
    one_error(zf("plan", "tiny-llama", "--data", "alpaca-sample", "--set", "train.micro_batch_size=1000",
                 "--set", "distributed.nproc=2"),
              "one micro-batch per process x 2 processes is more than the 1,880 training records")
    assert zf("plan", "tiny-llama", "--data", "alpaca-sample", "--set", "train.micro_batch_size=1880").exit_code == 0
    assert not (tmp_path / "run").exists()


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl(path: Path, rows: list) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


GOOD = {"instruction": "Say hi.", "output": "hi"}
# (what, the file, the text the one error line must hold)
BAD_DATA = [
    ("csv without a header row", lambda t: _write(t / "nohdr.csv", "What is 0+1?,1\nWhat is 1+1?,2\nWhat is 2+2?,4\n"),
     ("record 1: field 'instruction' is missing: a CSV's first line names its columns, and this file's "
      "('What is 0+1?', '1') reads as a record, not as names: the header row is missing; add one as the first "
      "line, e.g. instruction,output")),
    ("null chat content", lambda t: _jsonl(t / "c.jsonl", [{"messages": [
        {"role": "user", "content": None}, {"role": "assistant", "content": "x"}]}]),
     "record 1: field 'messages[0].content' is null; give it a text"),
    ("null ShareGPT value", lambda t: _jsonl(t / "s.jsonl", [{"conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": None}]}]),
     "record 1: field 'conversations[1].value' is null; give it a text"),
]


@pytest.mark.parametrize("what, make, needle", BAD_DATA, ids=[b[0] for b in BAD_DATA])
def test_bad_records_say_what_is_wrong(tmp_path: Path, what: str, make, needle: str) -> None:
    data = make(tmp_path)
    for verb in ("plan", "finetune"):
        result = zf(verb, "tiny-llama", "--data", data, "--output", tmp_path / "run")
        assert result.exit_code == 2, result.output
        errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1 and needle in errors[0], result.stderr
        assert all(ln.startswith(("error: ", "note: ")) for ln in result.stderr.strip().splitlines())
        assert "Traceback" not in result.output and "run plan" not in result.stdout
    assert not (tmp_path / "run").exists()


def test_records_count_from_one_as_editors_number_lines(tmp_path: Path) -> None:
    from zfctl.errors import UserError
    from zfctl.plan.schema import DataConfig, ModelConfig
    from zfctl.train.data.prepare import prepare_data
    from zfctl.train.data.source import read_file
    from zfctl.train.models.load import load_tokenizer

    data = _jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, {"instruction": None, "output": "x"}, GOOD])
    with pytest.raises(UserError, match=r"d\.jsonl: record 3: field 'instruction' is null"):
        prepare_data(DataConfig(name="d", source="local", path=str(data)), load_tokenizer(ModelConfig()), seed=0,
                     cache_dir=tmp_path / "cache")
    broken = _write(tmp_path / "b.jsonl", json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(UserError, match=r"b\.jsonl: line 3 \(record 3\) is not valid JSON"):
        read_file(broken)


def test_an_empty_data_argument_is_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for verb in ("plan", "finetune"):
        one_error(zf(verb, "tiny-llama", "--data", ""), "--data '': no data given; give a data preset")
    assert list(tmp_path.iterdir()) == []


def test_resume_with_an_unknown_strategy_names_that_flag_alone(trained: Path) -> None:
    before = tree(trained)
    line = one_error(zf("resume", trained, "--strategy", "zero3"), "--strategy zero3: use one of zero2, fsdp, auto")
    assert line.startswith("error: --strategy zero3"), line  # not "--nproc None: ..."
    assert tree(trained) == before


def test_resume_after_the_data_file_was_deleted_says_to_put_it_back(tmp_path: Path) -> None:
    data = tmp_path / "mine.jsonl"
    shutil.copy(ROOT / "presets/samples/alpaca-sample/train.jsonl", data)
    out = tiny_run(tmp_path / "run", str(data), "data.end_idx=64")
    data.unlink()
    before = tree(out)
    line = one_error(zf("resume", out, "--max-steps", "3"), f"its training data {data} (data.path in its plan) is gone")
    assert "put the file back at that path" in line and "--data" not in line, line
    assert tree(out) == before


def test_generate_on_an_export_without_tokenizer_files_names_them_and_the_fix(trained: Path, tmp_path: Path) -> None:
    """Defect 3: only config.json and model.safetensors (a copied export): one line, exit 2."""
    full = export(trained, tmp_path / "hf")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(full / name, bare / name)
    line = one_error(zf("generate", bare, "--prompt", "hi"), f"{bare} has no tokenizer files")
    assert "tokenizer.json" in line and "config.json, model.safetensors" in line, line
    assert f"zfctl export RUN --output {bare} --force" in line, line
    assert sorted(p.name for p in bare.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.slow
def test_a_prompt_longer_than_the_model_is_one_line_without_a_transformers_warning(trained: Path) -> None:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "zfctl", "generate", str(trained), "--prompt", "word " * 3000],
                       cwd=ROOT, env=env, text=True, capture_output=True, timeout=300, check=False)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: --prompt: ") and p.stderr.count("\n") == 1, p.stderr  # no [transformers] line
    assert "give a shorter prompt" in p.stderr
