"""Many nodes: two ``torchrun`` launches of 2 processes each, joined by a c10d rendezvous on
127.0.0.1 (gloo), train as one 4-rank job and lose what one process with the same global batch
loses (README, "Multi-GPU": the same command on every node)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed_cli import ENV, ROOT, TINY, losses

NODES, PER_NODE = 2, 2


def _free_port() -> int:
    """A port free now. c10d's store listens on a TCP port (no file rendezvous here); another process
    taking it between this check and torchrun's bind would fail the launch loudly, not silently."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_nodes(*args: str, rdzv_id: str = "zfctl-2x2") -> list[str]:
    """``zfctl ARGS`` under NODES torchrun launches of PER_NODE processes joined by one c10d
    rendezvous on 127.0.0.1, as on NODES machines; every launch must exit 0. Their logs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", rdzv_id,
           "-m", "zfctl", *args]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(NODES)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in nodes] == [0] * NODES, logs
    return logs


@pytest.mark.slow
def test_two_nodes_of_two_processes_match_one_process(one_process_run: Path, tmp_path: Path) -> None:
    """Needs the two launches of 2 (the claim) and the shared one-process run with micro-batch 4
    (tests/conftest.py): the same global batch."""
    one, multi = one_process_run, tmp_path / "2x2"
    sets = [a for s in [*TINY, "train.micro_batch_size=1"] for a in ("--set", s)]
    logs = two_nodes("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", str(multi), *sets)
    assert sum(log.count("run plan") for log in logs) == 1  # rank 0 of the whole job prints, once

    l1, l4 = losses(one), losses(multi)
    assert len(l1) == len(l4) == 6
    for a, b in zip(l1, l4):
        assert abs(a - b) <= 1e-5 * abs(a), (l1, l4)
    final = multi / "checkpoints/step-000006"
    assert sorted(p.name for p in final.glob("optimizer-rank*")) == [
        f"optimizer-rank{r:05d}.safetensors" for r in range(NODES * PER_NODE)]
