"""Checkpoints you can trust: digests, the non-finite guard, disk-full, through the real CLI.

Each failure is asserted three ways: the exit code, exactly one `error:` line, and nothing in the
run folder damaged (file digests compared before and after). A 2-layer, 64-wide tiny-llama keeps
every run to a few seconds on one core.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from conftest import widen_consoles
from proc_helpers import one_thread
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import RunFailed, UserError
from zfctl.train import checkpoint as ck
from zfctl.train import checksum
from zfctl.train import loss as train_loss
from zfctl.train.checkpoint import space
from zfctl.train.metrics import read_metrics

# One intra-op thread for every run here, the module's shared one too (proc_helpers.one_thread):
# test_latest_good_resumes_from_the_newest_intact_checkpoint compares its bytes with a rerun's.
pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=96", "data.max_length=64", "train.micro_batch_size=4", "train.eval_batches=2",
    "train.device=cpu", "train.precision=fp32", "train.eval_every=0", "logging.every=1",
    "zenflow.update_interval=2", "zenflow.topk_ratio=0.1", "checkpoint.every=2", "checkpoint.keep_last=2",
]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch, 300)


def zf(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def finetune(out: Path, *extra: str, steps: int = 4):
    sets = [a for s in [*TINY, *extra] for a in ("--set", s)]
    return zf("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", out, "--max-steps", steps, *sets)


def errors(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("error:")]


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (dot-folders included) and its sha256: 'nothing damaged'."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (copied per test)."""
    out = tmp_path_factory.mktemp("trust") / "run"
    with one_thread():
        res = finetune(out)
    assert res.exit_code == 0, res.output
    return out


def _copy(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def _garble(path: Path) -> None:
    """Overwrite bytes in the middle of ``path``: same size, header intact (a disk or copy error
    that a size check misses)."""
    size = path.stat().st_size
    n = min(4096, max(1, size // 4))
    with open(path, "r+b") as f:
        f.seek(size // 2 - n // 2)
        old = f.read(n)
        f.seek(size // 2 - n // 2)
        f.write(bytes((b ^ 0x5A) for b in old))  # every byte changes
    assert path.stat().st_size == size


def test_meta_records_a_digest_per_file_that_matches_the_bytes(trained: Path) -> None:
    info = ck.resolve_checkpoint(trained)
    meta = json.loads((info.path / ck.META).read_text())
    assert meta["hash"] == "xxh3_128" and set(meta["digests"]) == set(meta["files"])
    for name, digest in meta["digests"].items():
        assert checksum.file_digest(info.path / name) == digest
    assert ck.damaged_files(info) == []


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer-rank00000.safetensors", "rng-rank00000.pt",
                                  "trainer.pt", "plan.yaml"])
def test_same_size_corruption_of_each_file_is_refused_with_the_way_back(trained: Path, tmp_path: Path,
                                                                         name: str) -> None:
    run = _copy(trained, tmp_path)
    _garble(run / "checkpoints" / "step-000004" / name)
    before = tree(run)
    res = zf("resume", run, "--max-steps", 6)
    assert res.exit_code == 2, res.output
    (line,) = errors(res.output)
    good = run / "checkpoints" / "step-000002"
    assert f"{name} does not match the digest" in line and "step-000004 is damaged" in line
    assert f"`zfctl resume {good}`" in line and "--latest-good" in line
    assert len(res.output.strip().splitlines()) == 1  # refused before the plan is printed
    assert tree(run) == before
    # Export verifies the same way (the library call).
    from zfctl.train import export

    if name != "rng-rank00000.pt":  # export reads every file but the RNG states
        with pytest.raises(UserError, match=f"{name} does not match the digest"):
            export(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and tree(run) == before


def test_latest_good_resumes_from_the_newest_intact_checkpoint(trained: Path, tmp_path: Path) -> None:
    run = _copy(trained, tmp_path)
    _garble(run / "checkpoints" / "step-000004" / "model.safetensors")
    res = zf("resume", run, "--latest-good", "--max-steps", 4)
    assert res.exit_code == 0, res.output
    assert "newest intact checkpoint" in res.output and "step-000002" in res.output
    # Steps 3-4 ran again from step 2 and replaced the damaged folder with an intact one,
    # on the same trajectory as the original run (bit-identical on CPU).
    info = ck.resolve_checkpoint(run)
    assert info.step == 4 and ck.damaged_files(info) == []
    ref = ck.resolve_checkpoint(trained)
    assert (info.path / "model.safetensors").read_bytes() == (ref.path / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_nan_step_stops_the_run_and_keep_last_keeps_the_good_checkpoints(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = train_loss.lm_loss_sum, {"n": 0}

    def poisoned(logits, labels):  # the 5th micro-batch (step 5) produces NaN, like a bad record
        calls["n"] += 1
        loss = real(logits, labels)
        return loss * float("nan") if calls["n"] == 5 else loss

    monkeypatch.setattr(train_loss, "lm_loss_sum", poisoned)  # forward_backward's own name for it
    out = tmp_path / "run"
    res = finetune(out, "checkpoint.every=1", steps=8)
    assert res.exit_code == 1, res.output
    (line,) = errors(res.output)
    assert line.startswith("error: step 5: loss nan") and "no checkpoint was written from this state" in line
    assert "train.lr" in line and "step-000004" in line
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000003", "step-000004"]
    assert (root / "latest").read_text().strip() == "step-000004"
    assert not list(root.glob(".tmp-*"))
    for step in (3, 4):
        assert ck.damaged_files(ck.read_checkpoint(root / f"step-{step:06d}")) == []
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"][-1] == 5


def test_non_finite_weights_are_never_written(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    def save(step: int, m: torch.nn.Module) -> Path:
        return ck.save_checkpoint(tmp_path, step, model=m, optimizer_state={"x": torch.ones(2)},
                                  trainer_state={"step": step}, write_plan=lambda p: p.write_text("train: {}\n"),
                                  keep_last=1)

    save(1, model)
    before = tree(tmp_path)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(RunFailed, match=r"step 2: the model weights hold NaN or inf \(weight\)"):
        save(2, model)
    assert tree(tmp_path) == before  # step 1 intact, still latest, nothing left behind


class _Full:
    """Replaces HashingWriter's file with one that raises ENOSPC once ``budget`` bytes are written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, budget: int, target: str) -> None:
        real_init = checksum.HashingWriter.__init__
        self.left = budget

        def init(w, f):
            real_init(w, f)
            if str(getattr(f, "name", "")).endswith(target):
                w._f = self._wrap(f)

        monkeypatch.setattr(checksum.HashingWriter, "__init__", init)

    def _wrap(self, f):
        full = self

        class Wrapped:
            def write(self, data):
                n = memoryview(data).nbytes
                if n > full.left:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
                full.left -= n
                return f.write(data)

            def flush(self):
                f.flush()

            def fileno(self):
                return f.fileno()

        return Wrapped()


@pytest.mark.parametrize(("name", "budget"), [("optimizer-rank00000.safetensors", 0),  # inside the state writer
                                              ("model.safetensors", 100_000)])  # mid-tensor
def test_disk_full_during_a_save_is_one_line_and_leaves_no_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                name: str, budget: int) -> None:
    _Full(monkeypatch, budget, f".tmp-step-000004/{name}")
    out = tmp_path / "run"
    res = finetune(out, steps=6)
    assert res.exit_code == 1, res.output
    (line,) = errors(res.output)
    assert "cannot write the checkpoint of step 4: No space left on device (errno 28)" in line
    assert "the partial folder was removed" in line and "step-000002 is intact" in line
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002"]
    assert ck.damaged_files(ck.resolve_checkpoint(out)) == []


def test_not_enough_space_is_refused_before_anything_is_written(trained: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(space.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 10**6, 10**6))
    out = tmp_path / "run"
    res = finetune(out)
    assert res.exit_code == 2, res.output
    (line,) = errors(res.output)
    assert "not enough disk space for a checkpoint: needs" in line and "1 MB free at" in line
    assert len(res.output.strip().splitlines()) == 1  # from the plan's parameter count, before the plan
    assert not out.exists()
    # resume measures the newest checkpoint instead (after the plan: it is read from the checkpoint)
    run = _copy(trained, tmp_path)
    before = tree(run)
    res = zf("resume", run, "--max-steps", 6)
    needed = space._fmt_bytes(ck.last_size(run / "checkpoints"))  # the newest checkpoint's size
    assert res.exit_code == 2 and f"needs {needed}, 1 MB free" in errors(res.output)[0], res.output
    assert tree(run) == before


def test_a_stale_tmp_folder_is_removed_on_the_next_start(trained: Path, tmp_path: Path) -> None:
    run = _copy(trained, tmp_path)
    stale = run / "checkpoints" / ".tmp-step-000006"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    res = zf("resume", run, "--max-steps", 5)
    assert res.exit_code == 0, res.output
    assert not stale.exists()


@pytest.mark.parametrize(("setting", "expect"), [
    ("train.lr=.inf", "error: train.lr=inf: expected a finite number"),
    ("train.lr=-.inf", "error: train.lr=-inf: expected a finite number"),
    ("train.eps=.nan", "error: train.eps=nan: expected a finite number"),
    ("zenflow.tuning.auto_ratio=.inf", "error: zenflow.tuning.auto_ratio=inf: must be a number in (0, 1], e.g. 0.99"),
    ("train.betas=[0.9,.inf]", "error: train.betas[1]=inf: expected a finite number"),
    ("model.config.rope_theta=.inf", "error: model.config.rope_theta=inf: expected a finite number"),
    ("data.max_length=1000000000",
     ("error: data.max_length=1000000000: exceeds the model's max_position_embeddings (1024); "
      "set data.max_length <= 1024")),
])
def test_bad_values_are_one_line_before_the_plan(tmp_path: Path, setting: str, expect: str) -> None:
    res = zf("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", tmp_path / "r", "--set", setting)
    assert res.exit_code == 2 and res.output.strip() == expect, res.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("args", "expect"), [
    (["finetune", "tiny-llama", "--data", "alpaca-sample", "--nproc", "0"],
     ("error: Invalid value for '--nproc': Input should be greater than or equal to 1; "
      "see `zfctl finetune --help`")),
    (["finetune", "tiny-llama", "--data", "alpaca-sample", "--max-steps", "0"],
     "error: Invalid value for '--max-steps'"),
    (["resume", "/no/such/run"], "error: Invalid value for 'CKPT_DIR': path '/no/such/run' does not exist"),
    (["finetune", "tiny-llama"], "error: Missing option '--data'"),
    (["finetun"], "error: No such command 'finetun'"),
    (["--bogus"], "error: No such option: --bogus"),
])
def test_parser_errors_are_one_error_line(args: list[str], expect: str) -> None:
    res = zf(*args)
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1 and res.output.startswith(expect), res.output


def test_output_and_data_problems_come_before_the_plan(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    res = zf("finetune", "tiny-llama", "--data", bad, "--output", tmp_path / "r")
    assert res.exit_code == 2 and res.output.strip() == (
        f"error: {bad}: record 1: field 'instruction' is missing (the record has 'foo'); if another field "
        "holds it, --set data.fields.instruction=THAT_FIELD, or --set data.template=prompt_completion for "
        "prompt/completion records")
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = zf("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", afile)
    assert res.exit_code == 2 and res.output.strip().startswith(f"error: output {afile} exists and is not a folder")
    assert afile.read_text() == "x"


def test_a_failed_save_after_resuming_an_older_checkpoint_names_that_one(trained: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Resumed from step 2, the run's first save (step 4) fails. `latest` still names the abandoned
    # timeline's step 4, which is not this run's past: the way back is step 2.
    run = _copy(trained, tmp_path)
    _Full(monkeypatch, 0, ".tmp-step-000004/optimizer-rank00000.safetensors")
    older = run / "checkpoints" / "step-000002"
    res = zf("resume", older, "--max-steps", 6)
    assert res.exit_code == 1, res.output
    (line,) = errors(res.output)
    assert "cannot write the checkpoint of step 4" in line, line
    assert f"the last checkpoint {older} is intact (resume with `zfctl resume {older}`)" in line, line


def test_a_full_disk_on_the_metrics_file_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process filled the disk after the space check: the per-step metrics write fails
    # first, and a write() error carries no file name of its own.
    from zfctl.train import metrics

    class FullDisk:
        def __init__(self, f) -> None:
            self.f, self.lines = f, 0

        def write(self, text: str) -> int:
            self.lines += 1
            if self.lines > 3:  # after the checkpoint of step 2
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(text)

        def close(self) -> None:
            self.f.close()
            if self.lines > 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # its buffered tail, again

        @property
        def closed(self) -> bool:
            return self.f.closed

    real_init = metrics.MetricsWriter.__init__

    def init(w, *args, **kwargs) -> None:
        real_init(w, *args, **kwargs)
        w._f = FullDisk(w._f)

    monkeypatch.setattr(metrics.MetricsWriter, "__init__", init)
    out = tmp_path / "run"
    res = finetune(out, steps=6)
    assert res.exit_code == 1, res.output
    (line,) = errors(res.output)
    assert line.startswith(f"error: cannot append to {out / 'metrics.jsonl'}: No space left on device (ENOSPC)")
    assert f"`zfctl resume {out}`" in line and "Traceback" not in res.output
    assert ck.resolve_checkpoint(out).step == 2


@pytest.mark.parametrize("allow", [False, True])
def test_a_garbled_run_folder_plan_does_not_block_resume(trained: Path, tmp_path: Path, allow: bool) -> None:
    run = _copy(trained, tmp_path)
    (run / "plan.yaml").write_bytes(b"train: [\x00\xff garbled\n")
    flags = ["--allow-changes"] if allow else []
    res = zf("resume", run, "--max-steps", 5, *flags)
    if allow:  # the edited plan was asked for: it must be readable
        assert res.exit_code == 2, res.output
        (line,) = errors(res.output)
        assert "--allow-changes resumes with the edited" in line and "resume without --allow-changes" in line
        return
    assert res.exit_code == 0, res.output
    assert f"note: {run / 'plan.yaml'} cannot be read" in res.output and "checkpoint's copy" in res.output
    newest = ck.resolve_checkpoint(run)
    assert newest.step == 5
    assert (run / "plan.yaml").read_text() == (newest.path / "plan.yaml").read_text()  # the checkpoint's plan
    # --latest-good takes the same way
    (run / "plan.yaml").write_text("train: [\n")
    assert zf("resume", run, "--latest-good", "--max-steps", 6).exit_code == 0


def test_resume_refuses_training_data_edited_with_the_same_record_count(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    rows = [{"instruction": f"Count to {i}.", "output": " ".join(map(str, range(1, i + 2)))} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    sets = [a for s in TINY for a in ("--set", s)]
    res = zf("finetune", "tiny-llama", "--data", data, "--output", run, "--max-steps", 2, *sets)
    assert res.exit_code == 0, res.output
    os.utime(data, (1, 1))  # touched, not changed: the content decides, not the mtime
    assert zf("resume", run, "--max-steps", 3).exit_code == 0
    rows[7]["output"] = "seven"  # one answer edited: still 40 records
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = tree(run)
    res = zf("resume", run, "--max-steps", 4)
    assert res.exit_code == 2, res.output
    (line,) = errors(res.output)
    assert "the training data changed since the checkpoint" in line and "the same" in line, line
    assert "other tokens" in line and "pass --allow-changes to continue on the new data" in line, line
    assert tree(run) == before
    res = zf("resume", run, "--max-steps", 4, "--allow-changes")
    assert res.exit_code == 0, res.output
    assert "continuing on the new data (--allow-changes)" in res.output
    assert ck.resolve_checkpoint(run).step == 4
    assert zf("resume", run, "--max-steps", 5).exit_code == 0  # its checkpoints hold the new data's digest
