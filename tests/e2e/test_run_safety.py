"""Runs that cannot hurt each other or the user's files: the run lock, export --force, the --nproc
launcher owning its ranks, write pre-flight and OS errors as one line, double Ctrl-C.

Process tests poll for conditions (never fixed sleeps) with generous timeouts: the machine may
be a loaded 2-core box. Read-only destinations are real ones: a 0555 folder for a normal user;
as root (who writes through 0555) a read-only bind mount made inside a private mount namespace
(``unshare -m``) that only the command under test sees; where neither works, /sys (which
refuses file creation even to root).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import widen_consoles
from proc_helpers import alive, children, metric_steps
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.train import lock
from zfctl.train.checkpoint import read_checkpoint, resolve_checkpoint
from zfctl.train.rundir import check_output_dir
from zfctl.train.testhooks import SLOW_WRITE_ENV

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=96", "data.max_length=64", "train.eval_batches=2", "train.eval_every=0",
    "train.device=cpu", "train.precision=fp32", "logging.every=1", "zenflow.topk_ratio=0.1",
    "zenflow.update_interval=2", "zenflow.cpu_threads=1",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch)


class Proc:
    """A `python -m zfctl` subprocess whose merged output is collected by a reader thread."""

    def __init__(self, *args: str, env: dict | None = None, wrap: list[str] | None = None,
                 new_session: bool = False) -> None:
        cmd = [*(wrap or []), sys.executable, "-m", "zfctl", *args]
        self.p = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
                                  start_new_session=new_session)
        self._chunks: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self._chunks.append(line)

    @property
    def out(self) -> str:
        return "".join(self._chunks)

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float = 150) -> None:
        t0 = time.monotonic()
        while not cond():
            if self.p.poll() is not None:
                self._reader.join(10)
                raise AssertionError(f"ended early (rc {self.p.returncode}) waiting for {what}:\n{self.out}")
            if time.monotonic() - t0 > timeout:
                self.p.kill()
                raise AssertionError(f"timed out waiting for {what}:\n{self.out}")
            time.sleep(0.05)

    def finish(self, timeout: float = 150) -> tuple[int, str]:
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise
        self._reader.join(10)
        return self.p.returncode, self.out


def sets(*extra: str) -> list[str]:
    return [a for s in [*TINY, *extra] for a in ("--set", s)]


def finetune(out: Path, *extra: str, nproc: int | None = None, **kw) -> Proc:
    more = ["--nproc", str(nproc)] if nproc else []
    return Proc("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(out), *more,
                *sets(*extra), **kw)


def run_cli(*args: str, wrap: list[str] | None = None, timeout: float = 150) -> tuple[int, str]:
    return Proc(*args, wrap=wrap).finish(timeout)


def one_line_error(rc: int, log: str, *needles: str) -> str:
    assert rc == 2, log
    assert "Traceback" not in log, log
    errors = [ln for ln in log.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, log
    assert all(n in errors[0] for n in needles), log
    return errors[0]


# finished_run: tests/conftest.py, a finished 2-step run shared with tests/cli/test_train_cli.py


# ------------------------------------------------------------------------------ the run lock


def test_lock_names_the_holder_and_a_killed_holder_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    held = lock.acquire(run)
    try:
        # another process (flock is per open file: a second process is the real case)
        probe = subprocess.run([sys.executable, "-c", (
            "import sys; from zfctl.train import lock\n"
            "try: lock.acquire(__import__('pathlib').Path(sys.argv[1]))\n"
            "except lock.RunInUse as e: print(e); sys.exit(3)\n"), str(run)],
            check=False, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
        assert probe.returncode == 3, probe.stderr
        assert f"is in use by pid {os.getpid()} on " in probe.stdout and "since " in probe.stdout
        with pytest.raises(lock.RunInUse):
            lock.check_free(run)
    finally:
        held.release()
    assert not (run / lock.LOCK_FILE).exists()  # a clean release leaves nothing behind

    # A holder killed with SIGKILL leaves its lock file (the kernel dropped the flock).
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from zfctl.train import lock\n"
        "lock.acquire(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)\n"), str(run)],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    holder.send_signal(signal.SIGKILL)
    holder.wait(60)
    assert str(holder.pid) in (run / lock.LOCK_FILE).read_text()
    lock.check_free(run)  # not in use any more
    check_output_dir(run, force=False)  # a leftover lock file alone does not make a folder non-empty
    notes: list[str] = []
    again = lock.acquire(run, note=notes.append)
    assert len(notes) == 1 and f"took over the lock of pid {holder.pid}" in notes[0], notes
    assert str(os.getpid()) in (run / lock.LOCK_FILE).read_text()
    again.release()


@pytest.mark.slow
def test_second_finetune_force_and_second_resume_against_a_live_run(tmp_path):
    run = tmp_path / "run"
    live = finetune(run, "train.micro_batch_size=4", "train.max_steps=100000", "checkpoint.every=2")
    live.wait_for(lambda: (run / "checkpoints" / "latest").exists(), "the first checkpoint")
    try:
        # both at once (each is a Python + torch start-up: seconds on a loaded machine)
        force = Proc("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(run), "--force",
                     *sets("train.max_steps=3"))
        resume = Proc("resume", str(run))
        one_line_error(*force.finish(), f"run folder {run} is in use by pid {live.p.pid} on ", "since ")
        one_line_error(*resume.finish(), f"run folder {run} is in use by pid {live.p.pid} on ")
        assert live.p.poll() is None, live.out  # the live run was not disturbed...
    finally:
        live.p.send_signal(signal.SIGTERM)
    rc, log = live.finish()
    assert rc == 143, log
    assert "Traceback" not in log, log
    # ...and lost nothing: one writer, contiguous steps, its stop checkpoint intact.
    steps = metric_steps(run)
    assert steps == list(range(1, len(steps) + 1)), steps
    assert resolve_checkpoint(run).step == steps[-1]
    assert not (run / lock.LOCK_FILE).exists()


@pytest.mark.slow
def test_stale_lock_of_a_dead_process_is_taken_over_with_a_note(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)  # the shared run stays as it was
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(60)
    (run / lock.LOCK_FILE).write_text(
        f'{{"pid": {dead.pid}, "host": "gone-host", "started": "2020-01-01T00:00:00+0000"}}\n')
    rc, log = run_cli("resume", str(run))  # already at max_steps: trains nothing
    assert rc == 0, log
    assert f"took over the lock of pid {dead.pid} on gone-host" in log, log
    # a finished run is not reloaded: it says so (under the lock it took over)
    assert f"finished: {run} ended at step 2 ({run / 'checkpoints' / 'step-000002'})" in log, log
    assert not (run / lock.LOCK_FILE).exists()


# ------------------------------------------------------------------------------ export --force


def export_in_process(*args: str) -> tuple[int, str]:
    """``zfctl export ARGS`` through the Typer app: a refusal in its pre-flight needs no process."""
    result = runner.invoke(app, ["export", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


@pytest.mark.slow
def test_export_force_never_replaces_a_file_or_a_foreign_folder(finished_run, tmp_path):
    foreign = tmp_path / "thesis"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("\\documentclass{article}")
    rc, log = export_in_process(str(finished_run), "--output", str(foreign), "--force")
    one_line_error(rc, log, f"--output {foreign} is not empty and was not written by zfctl export")
    assert [p.name for p in foreign.iterdir()] == ["thesis.tex"]
    assert (foreign / "thesis.tex").read_text() == "\\documentclass{article}"

    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    rc, log = export_in_process(str(finished_run), "--output", str(a_file), "--force")
    one_line_error(rc, log, f"--output {a_file} is a file, not a folder")
    assert a_file.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "thesis"]  # no temp folders


# ------------------------------------------------------------------------------ the launcher


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "process group"])
def test_sigterm_to_nproc2_launcher_leaves_no_process_and_a_resumable_checkpoint(tmp_path, target):
    run = tmp_path / "run"
    launcher = finetune(run, "train.micro_batch_size=2", "train.max_steps=100000", "checkpoint.every=0",
                        nproc=2, new_session=True)
    ranks: list[int] = []

    def training() -> bool:
        ranks[:] = [w for t in children(launcher.p.pid) for w in children(t)]
        return len(ranks) == 2 and len(metric_steps(run)) >= 1

    launcher.wait_for(training, "both ranks training")
    torchrun = children(launcher.p.pid)
    assert len(torchrun) == 1, torchrun
    if target == "launcher":
        os.kill(launcher.p.pid, signal.SIGTERM)
    else:  # what `kill -TERM -PGID` or a job scheduler does
        os.killpg(launcher.p.pid, signal.SIGTERM)
    rc, log = launcher.finish()
    assert rc == 143, log
    assert "Traceback" not in log and "ChildFailedError" not in log, log
    assert "stopped by SIGTERM after step" in log, log
    for pid in [*torchrun, *ranks]:  # all reaped: torchrun by the launcher, ranks by torchrun
        assert not alive(pid), (pid, log)
    info = read_checkpoint(resolve_checkpoint(run).path)  # every file has its recorded size
    assert info.world_size == 2 and info.step == metric_steps(run)[-1]
    assert {p.name for p in info.path.glob("optimizer-rank*")} == {"optimizer-rank00000.safetensors",
                                                                     "optimizer-rank00001.safetensors"}
    assert not (run / lock.LOCK_FILE).exists()
    if target != "launcher":
        return  # the refusal below reads the checkpoint alone: one of the two cases checks it
    # A world size that cannot keep the global batch (2 micro-batches per step) is refused before
    # relaunching: one line, not a ChildFailedError per rank.
    rc, log = run_cli("resume", str(run), "--nproc", "3")
    one_line_error(rc, log, "--nproc 3: cannot resume on 3 process(es)", "resume with --nproc 1 / 2")


# ------------------------------------------------------------------------------ Ctrl-C twice


@pytest.mark.slow
def test_second_ctrl_c_aborts_with_one_line_saying_no_checkpoint_was_written(tmp_path):
    run = tmp_path / "run"
    # The step-3 checkpoint write sleeps (test hook): both signals land inside it, deterministically.
    p = finetune(run, "train.micro_batch_size=4", "train.max_steps=50", "checkpoint.every=1",
                 env={SLOW_WRITE_ENV: "3:120"})
    p.wait_for((run / "checkpoints" / ".tmp-step-000003" / "model.safetensors").exists, "the slow write")
    p.p.send_signal(signal.SIGINT)
    p.wait_for(lambda: "stop requested" in p.out, "the first Ctrl-C to be handled")
    p.p.send_signal(signal.SIGINT)
    rc, log = p.finish()
    assert rc == 130, log
    assert "Traceback" not in log, log
    aborted = [ln for ln in log.splitlines() if "aborted" in ln]
    assert aborted == [(f"aborted by a second SIGINT: no checkpoint was written; the newest in {run} is "
                        f"step 2 (continue: zfctl resume {run})")], log
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert not (run / lock.LOCK_FILE).exists()  # released on the way out


# ------------------------------------------------------------------------------ read-only destinations


@pytest.fixture
def readonly(tmp_path) -> tuple[Path, list[str]]:
    """(a folder the command under test cannot write to, a command prefix that makes it so)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro, []
        ro.chmod(0o755)
        return
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-m", "true"], check=False, capture_output=True).returncode == 0:
        script = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1" && shift && exec "$@"'
        yield ro, [unshare, "-m", "sh", "-c", script, "sh", str(ro)]
        return
    yield Path("/sys"), []  # sysfs refuses file creation, root included


@pytest.mark.slow
def test_readonly_destinations_are_refused_before_any_work(readonly, finished_run):
    ro, wrap = readonly
    before = sorted(ro.iterdir())
    cases = [
        (["finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(ro / "run"),
          *sets("train.max_steps=1")], f"--output {ro / 'run'}: cannot create files in {ro}"),
        (["export", str(finished_run), "--output", str(ro / "hf")], f"--output {ro / 'hf'}: cannot create files"),
        # a grid of 8 configurations would take minutes: the refusal must come first
        (["bench", "--json", str(ro / "b.json"), "--topk", "0.1,0.2", "--interval", "2,4", "--overlap", "on,off"],
         f"--json {ro / 'b.json'}: cannot create files in {ro}"),
        (["presets", "cp", "tiny-llama", f"{ro}/"], f"DEST {ro / 'tiny-llama.yaml'}: cannot create files in {ro}"),
    ]
    for args, needle in cases:
        rc, log = run_cli(*args, wrap=wrap)
        line = one_line_error(rc, log, needle)
        assert "Read-only file system (EROFS)" in line or "Permission denied (EACCES)" in line, line
        # refused before the work: no data prepared, no model written, no grid run
        assert "data: " not in log and "Writing model" not in log and "wrote" not in log, log
        if args[0] in ("bench", "presets"):
            assert [ln for ln in log.splitlines() if ln.strip()] == [line], log
    assert sorted(ro.iterdir()) == before


def test_oserror_on_a_write_is_one_line_exit_2(tmp_path, monkeypatch):
    # The pre-flight passes, then the disk fills during the copy: still one line, no traceback.
    def full(src, dst, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(shutil, "copyfile", full)
    result = runner.invoke(app, ["presets", "cp", "tiny-llama", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"error: {tmp_path / 'x.yaml'}: No space left on device (ENOSPC)" in result.output


# ------------------------------------------------------------------------------ small validations


def test_model_config_sizes_must_be_at_least_one():
    for key in ("num_hidden_layers=-1", "hidden_size=0", "num_key_value_heads=1.5"):
        result = runner.invoke(app, ["plan", "tiny-llama", "--data", "alpaca-sample", "--set", f"model.config.{key}"])
        assert result.exit_code == 2, result.output
        assert f"model.config.{key.split('=')[0]}=" in result.output and "must be an integer >= 1" in result.output


def test_presets_cp_into_a_missing_folder_with_a_slash_creates_it(tmp_path):
    dest = tmp_path / "configs" / "mine"
    result = runner.invoke(app, ["presets", "cp", "tiny-llama", f"{dest}/"])
    assert result.exit_code == 0, result.output
    assert (dest / "tiny-llama.yaml").is_file() and dest.is_dir()
    # without the slash a missing parent is still refused (no file named after a folder)
    result = runner.invoke(app, ["presets", "cp", "tiny-llama", str(tmp_path / "nope" / "x.yaml")])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not (tmp_path / "nope").exists()


def test_version_flag():
    from zfctl import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"zfctl {__version__}"


def test_resume_names_the_checkpoint_and_the_fallback_from_a_broken_latest(tmp_path):
    from zfctl.train import checkpoint as ck

    root = tmp_path / "run" / ck.CHECKPOINTS
    for step in (2, 4):
        d = root / ck.step_name(step)
        d.mkdir(parents=True)
        (d / ck.META).write_text(f'{{"step": {step}, "world_size": 1, "files": {{}}}}')
    (root / ck.LATEST).write_text("step-000006\n")  # deleted by hand
    notes: list[str] = []
    assert ck.resolve_checkpoint(tmp_path / "run", notes).step == 4
    assert notes == [(f"{root / ck.LATEST} names step-000006, which does not exist or has no meta.json; "
                      "falling back to the newest readable checkpoint, step-000004")]
    (root / ck.LATEST).write_text("step-000004\n")
    notes.clear()
    assert ck.resolve_checkpoint(tmp_path / "run", notes).step == 4 and notes == []
