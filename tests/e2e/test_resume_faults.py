"""Resumes that fail or meet damage never rewrite the run folder, and every line names the way on
(docs/design.md, "Failures and the run folder").

In-process (the Typer app, tiny 2-layer model, a few steps each): a resume that fails in its first
step leaves plan.yaml and metrics.jsonl byte for byte; leftover temporary files of atomic writes are
cleaned when a run takes its folder; `latest` and metrics.jsonl holding bytes that are not UTF-8
are one line, not a traceback; a damaged checkpoint's line names the nearest intact one with the
command of the verb at work (export and generate have no --latest-good); a run stopped before its
first checkpoint is sent to `finetune --force`; an edit of the data that keeps its size and mtime
is seen; a resume on one process of an fsdp plan says zero2, as its checkpoints do.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import widen_consoles
from proc_helpers import one_thread
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import RunFailed
from zfctl.plan.io import dump_plan_yaml, load_plan_yaml
from zfctl.plan.resolve import resolve_plan
from zfctl.plan.schema import DataConfig, ModelConfig
from zfctl.train import resume, run
from zfctl.train.checkpoint import PLAN_FILE, read_checkpoint
from zfctl.train.checksum import file_digest
from zfctl.train.data.prepare import prepare_data
from zfctl.train.metrics import read_metrics
from zfctl.train.models.load import load_tokenizer
from zfctl.train.testhooks import FAIL_ENV

# One intra-op thread for every run here, the module's shared one too (proc_helpers.one_thread).
pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4", "data.end_idx=64",
    "data.max_length=64", "train.micro_batch_size=4", "train.eval_every=0", "train.device=cpu",
    "train.precision=fp32", "train.schedule=constant", "zenflow.full_warm_up_rounds=0", "zenflow.update_interval=2",
    "checkpoint.every=1", "checkpoint.keep_last=3", "logging.every=1",
]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch, 400)


def zf(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def tiny_run(out: Path, steps: int, *extra: str) -> Path:
    run(resolve_plan("tiny-llama", "alpaca-sample",
                     overrides=[*TINY, f"train.max_steps={steps}", f"checkpoint.output_dir={out}", *extra]))
    return out


def tree(path: Path, skip: tuple[str, ...] = (".zfctl.lock",)) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes (the lock file aside: taken and left by any run)."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))
            if f.is_file() and f.name not in skip}


def errors(result) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> Path:
    """A 3-step run with a checkpoint after every step (each test works on a copy)."""
    with one_thread():
        return tiny_run(tmp_path_factory.mktemp("faults") / "three", 3)


def copy_of(run_dir: Path, tmp: Path) -> Path:
    shutil.copytree(run_dir, tmp / "run")
    return tmp / "run"


@pytest.mark.slow
def test_a_resume_that_fails_in_its_first_step_leaves_the_run_folder_as_it_was(three, tmp_path, monkeypatch):
    """Defect 2: the resume changes max_steps (plan.yaml would say 5) and its first step fails;
    plan.yaml, metrics.jsonl and the checkpoints are byte for byte as before. The resume that
    then trains writes them, the temporary files killed writes left cleaned as it takes the folder."""
    out = copy_of(three, tmp_path)
    before = tree(out)
    monkeypatch.setenv(FAIL_ENV, "0:4")  # step 4, the first step this resume trains
    with pytest.raises(RunFailed, match="step 4: failure injected"):
        resume(out, max_steps=5)
    assert tree(out) == before
    monkeypatch.delenv(FAIL_ENV)

    leftovers = [out / "checkpoints" / ".latest.4242.0a1b2c3d.tmp", out / ".plan.yaml.4242.0a1b2c3d.tmp",
                 out / "metrics.jsonl.tmp"]
    for f in leftovers:  # what a kill between writing a temporary file and its rename leaves
        f.write_text("half")
    assert resume(out, max_steps=5).steps == 5
    assert load_plan_yaml(out / PLAN_FILE).train.max_steps == 5
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl", "train")] == [1, 2, 3, 4, 5]
    assert not any(f.exists() for f in leftovers), [f for f in leftovers if f.exists()]


@pytest.mark.slow
def test_bytes_that_are_not_text_in_latest_or_metrics_are_one_line(three, tmp_path):
    """`latest` is a pointer: bytes that name nothing are treated as a missing pointer (the newest
    readable checkpoint, with a note), in resume with and without --latest-good, export and
    generate; metrics.jsonl lines that are not UTF-8 JSON are dropped like a torn line, with a note.
    One line each, never a UnicodeDecodeError traceback."""
    out = copy_of(three, tmp_path)
    lines = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (out / "metrics.jsonl").write_bytes(b"".join([lines[0], b'{"kind": "tr\xe9in", "step": 1}\n', *lines[1:]]))
    for args in (["generate", out, "--prompt", "hi", "--max-new-tokens", "2"],
                 ["export", out, "--output", tmp_path / "hf"],
                 ["resume", out, "--latest-good", "--max-steps", "4"], ["resume", out, "--max-steps", "5"]):
        (out / "checkpoints" / "latest").write_bytes(b"step-0\xff\xfe03\n")  # each time: a resume rewrites it
        result = zf(*args)
        assert result.exit_code == 0, (args, result.output)
        assert "Traceback" not in result.output and not errors(result), (args, result.output)
        if "--latest-good" not in args:  # which takes the newest intact checkpoint, with its own note
            assert "latest is not a checkpoint name" in result.stderr, (args, result.stderr)
        if args[-1] == "4":
            assert "1 line(s) that are no record" in result.stderr, result.stderr  # said as it is dropped
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl", "train")] == [1, 2, 3, 4, 5]


def test_a_damaged_checkpoint_names_the_nearest_intact_one_and_the_command_that_uses_it(three, tmp_path):
    out = copy_of(three, tmp_path)
    newest, intact = out / "checkpoints" / "step-000003", out / "checkpoints" / "step-000002"
    model = newest / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-10])  # truncated
    before = tree(out)
    cases = {  # verb: (arguments, the command its line must name)
        "resume": ([out], f"`zfctl resume {intact}` (or `zfctl resume {out} --latest-good`)"),
        "export": ([out, "--output", tmp_path / "hf"], f"`zfctl export {intact} --output {tmp_path / 'hf'}`"),
        "generate": ([out, "--prompt", "hi"], f"`zfctl generate {intact} --prompt hi`"),
    }
    for verb, (args, command) in cases.items():
        result = zf(verb, *args)
        assert result.exit_code == 2, result.output
        [line] = errors(result)
        assert f"checkpoint {newest} is unreadable: model.safetensors has" in line, line
        assert f"the nearest intact checkpoint is {intact} (step 2): use it with {command}" in line, line
        if verb != "resume":
            assert "--latest-good" not in line, line  # export and generate have no such flag
    # same size, other bytes: caught by the digest, the same advice
    shutil.copy(intact / "model.safetensors", model)
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    result = zf("export", out, "--output", tmp_path / "hf")
    [line] = errors(result)
    assert "does not match the digest" in line and f"`zfctl export {intact} --output {tmp_path / 'hf'}`" in line, line
    assert not (tmp_path / "hf").exists()
    assert {k: v for k, v in tree(out).items() if k != "checkpoints/step-000003/model.safetensors"} == {
        k: v for k, v in before.items() if k != "checkpoints/step-000003/model.safetensors"}


def test_a_run_stopped_before_its_first_checkpoint_is_sent_to_finetune_force(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[*TINY, f"checkpoint.output_dir={out}"])
    dump_plan_yaml(plan, out / PLAN_FILE)  # what a run killed in its first steps leaves
    (out / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 8.0}) + "\n")
    before = tree(out)
    [line] = errors(zf("resume", out))
    assert "its run stopped before writing one" in line and f"--output {out} --force" in line, line
    result = zf("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", out, "--max-steps", "1")
    [line] = errors(result)
    assert "--force" in line and "zfctl resume" not in line, line  # nothing to resume there
    assert tree(out) == before


def test_an_edit_that_keeps_the_size_and_mtime_of_the_data_is_seen(tmp_path):
    """The data cache keys on the file's content: an edit within the same second that keeps the
    length (or a copy that restores the mtime) gets new tokens, not the old cached ones."""
    data = tmp_path / "d.jsonl"
    rows = [{"instruction": f"Say {w}.", "output": w} for w in ("alpha", "bravo", "gamma", "delta")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, tok = DataConfig(name="d", source="local", path=str(data), validation_fraction=0.0), load_tokenizer(ModelConfig())
    first = prepare_data(cfg, tok, seed=0, cache_dir=tmp_path / "cache")
    st = data.stat()
    data.write_text(data.read_text().replace("gamma", "omega"))  # same length
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
    second = prepare_data(cfg, tok, seed=0, cache_dir=tmp_path / "cache")
    assert not second.stats.from_cache and second.train_digest != first.train_digest
    assert prepare_data(cfg, tok, seed=0, cache_dir=tmp_path / "cache").stats.from_cache  # unchanged: a hit


@pytest.mark.slow
def test_fsdp_on_one_process_is_planned_and_resumed_as_the_zero2_it_trains(three, tmp_path):
    """Defect 4: the printed plan, plan.yaml and the checkpoint agree (zero2), with a note."""
    result = zf("plan", "tiny-llama", "--data", "alpaca-sample", "--set", "distributed.strategy=fsdp", "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["plan"]["distributed"]["strategy"] == "zero2"
    assert any(n.startswith("distributed.strategy=fsdp on one process: nothing to shard over") for n in shown["notes"])
    out = copy_of(three, tmp_path)
    ckpt = out / "checkpoints" / "step-000003"  # as a zfctl without this resolution saved it: fsdp, on one process
    for plan_file in (ckpt / PLAN_FILE, out / PLAN_FILE):
        saved = load_plan_yaml(plan_file)
        saved.distributed.strategy = "fsdp"
        dump_plan_yaml(saved, plan_file)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][PLAN_FILE] = (ckpt / PLAN_FILE).stat().st_size
    meta["digests"][PLAN_FILE] = file_digest(ckpt / PLAN_FILE)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    result = zf("resume", out, "--max-steps", "4")
    assert result.exit_code == 0, result.output
    assert "nothing to shard over, so the run continues as zero2" in result.stderr, result.stderr
    ckpt = read_checkpoint(out / "checkpoints" / "step-000004")
    assert ckpt.meta["strategy"] == "zero2"
    assert load_plan_yaml(ckpt.path / PLAN_FILE).distributed.strategy == "zero2"
    assert load_plan_yaml(out / PLAN_FILE).distributed.strategy == "zero2"


@pytest.mark.slow
def test_resume_ends_as_finetune_does(three, tmp_path):
    out = copy_of(three, tmp_path)
    result = zf("resume", out, "--max-steps", "4")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any(ln.startswith("done 4 steps  train loss (last step) ") and "eval loss" in ln for ln in lines), lines
    assert f"checkpoint: {out / 'checkpoints' / 'step-000004'}" in lines, lines
    nxt = lines[lines.index("next:") + 1:]
    assert [ln.strip().split()[:2] for ln in nxt if ln.strip().startswith("zfctl")] == [
        ["zfctl", "generate"], ["zfctl", "export"], ["zfctl", "resume"]], nxt
    assert "continues the same LR schedule (constant" in result.stderr, result.stderr
