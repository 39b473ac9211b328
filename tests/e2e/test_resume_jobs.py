"""Resumes and faults of jobs of several processes, through torchrun (gloo on CPU, tiny model):

* a finished 2-process run is recognised before any process is launched (no torchrun start only
  to say it is finished);
* in a 2-process resume whose rank 1 meets a damaged file, the "resuming from" line comes before
  rank 1's error (the launcher prints it before any rank starts), and that error names the
  nearest intact checkpoint;
* two torchrun "nodes" of one process each: killing one node's agent takes its rank with it, the
  other node's job ends within seconds (not 300 s in torch's exit barrier), and the survivor's
  line gives the per-node torchrun resume command, as the README does.
Polls for conditions, never fixed sleeps: the machine may be a loaded 2-core box.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import widen_consoles
from proc_helpers import alive, children, metric_steps
from test_distributed_cli import ENV, ROOT, TINY, zfctl
from typer.testing import CliRunner

from zfctl.cli import app

pytestmark = pytest.mark.slow


def _sets(*extra: str) -> list[str]:
    return [a for s in [*TINY, "train.micro_batch_size=2", *extra] for a in ("--set", s)]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> Path:
    """A finished 2-process run, 2 steps: a newest checkpoint to damage and an intact one to name."""
    out = tmp_path_factory.mktemp("jobs") / "run"
    zfctl("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(out), "--nproc", "2",
          *_sets("train.max_steps=2", "checkpoint.every=1", "checkpoint.keep_last=2"))
    return out


def test_a_finished_two_process_run_is_known_before_torchrun_starts(two_rank_run: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # in this process (the Typer app): the launcher's own decision, no process of its own needed to see it
    widen_consoles(monkeypatch, 400)
    result = CliRunner().invoke(app, ["resume", str(two_rank_run)])
    assert result.exit_code == 0, result.output
    log = result.output
    assert "launching" not in log and "resuming from" not in log, log
    assert log.startswith(f"finished: {two_rank_run} ended at step 2 ("), log


def test_the_resuming_line_comes_before_a_ranks_error(two_rank_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(two_rank_run, run)
    newest, intact = run / "checkpoints/step-000002", run / "checkpoints/step-000001"
    shard = newest / "optimizer-rank00001.safetensors"  # read by rank 1 alone: same size, other bytes
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    p = subprocess.run([sys.executable, "-m", "zfctl", "resume", str(run), "--max-steps", "3"], cwd=ROOT, env=ENV,
                       text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, check=False)
    assert p.returncode == 2, p.stdout
    lines = p.stdout.splitlines()
    resuming = next(i for i, ln in enumerate(lines) if ln.startswith(f"resuming from {newest} (step 2"))
    launching = lines.index("launching 2 processes under torchrun (standalone)")
    error = next(i for i, ln in enumerate(lines) if ln.startswith("error: rank 1: checkpoint "))
    # printed by the launcher before any rank exists: not a race between rank 0's line and rank 1's error
    assert resuming < launching < error, p.stdout
    assert "optimizer-rank00001.safetensors does not match the digest" in lines[error], lines[error]
    assert f"the nearest intact checkpoint is {intact} (step 1): use it with `zfctl resume {intact}`" in lines[error]
    assert "Traceback" not in p.stdout, p.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:.0f} s")
        time.sleep(0.2)


def test_a_rank_dies_with_its_nodes_agent_and_the_survivor_gives_the_per_node_resume(tmp_path: Path) -> None:
    out = tmp_path / "2x1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "zfctl-agent",
           "-m", "zfctl", "finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(out),
           *_sets("train.max_steps=100000", "checkpoint.every=1", "checkpoint.keep_last=2")]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for _ in range(2)]
    logs: list[list[str]] = [[], []]
    readers = [threading.Thread(target=lambda i=i: logs[i].extend(nodes[i].stdout or []), daemon=True)
               for i in range(2)]
    for r in readers:
        r.start()
    try:
        _wait(lambda: len(metric_steps(out)) >= 2, "the job did not train two steps", 300)
        agent = nodes[1]
        ranks = children(agent.pid)
        assert len(ranks) == 1, ranks
        agent.send_signal(signal.SIGKILL)  # one node's torchrun agent, killed outright
        _wait(lambda: not alive(ranks[0]), "the killed agent's rank is still training", 30)
        start = time.monotonic()
        nodes[0].wait(timeout=240)
        assert time.monotonic() - start < 120  # not torch's 300 s exit barrier for a gone agent
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
            p.wait()
        for r in readers:
            r.join(timeout=10)
    survivor = "".join(logs[0])
    assert nodes[0].returncode != 0, survivor
    line = next(ln for ln in survivor.splitlines() if ln.startswith("error: rank 0: "))
    assert "by running on every node the torchrun command that started this job" in line, line
    assert f"-m zfctl resume {out}" in line and "--nnodes 2" in line and "--nproc-per-node 1" in line, line
    assert f"with `zfctl resume {out}`" not in line, line  # that relaunches on one node only
    # the rank's own ending is that one line; what follows it is the user's torchrun agent reporting
    # a failed worker (its ChildFailedError report, not zfctl's to shape)
    assert "Traceback" not in survivor.split("error: rank 0: ")[0], survivor
