"""`zfctl doctor` shows the core split and the NUMA layout (zfctl/cli/doctor.py, offload/cores.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import widen_consoles
from test_offload_cores import GPUS, two_sockets
from typer.testing import CliRunner

from zfctl.cli import app, doctor


def test_doctor_has_the_core_split_and_numa_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch, 400)
    out = CliRunner().invoke(app, ["doctor"])
    assert out.exit_code == 0
    assert "core split" in out.output and "reserved for the training thread" in out.output
    assert "update pool" in out.output and "NUMA" in out.output and "node(s)" in out.output


def test_doctor_on_a_two_socket_gpu_machine(tmp_path: Path) -> None:
    """What a 2-node, 32-CPU machine with 4 GPUs shows for GPU 0 (a fake sysfs)."""
    m = two_sockets(tmp_path)
    status, split = doctor.check_core_split(m, torch.device("cuda", 0))
    assert status == "info" and split.startswith("with a GPU: ")
    assert "this rank's CPUs 0-7,16-23" in split  # GPU 0's node, the process is alone on it
    assert "reserved for the training thread: 0-1,16-17 (4)" in split  # 2 cores, both threads each
    assert "update pool 12 thread(s) on CPUs 2-7,18-23 (pinned)" in split  # every pool core, on every path
    assert "GOMP_CPU_AFFINITY=0-1,16-17" in split
    status, numa = doctor.check_numa(m, torch.device("cuda", 0), pcis=list(GPUS))
    assert numa.startswith("2 node(s) (node 0: CPUs 0-7,16-23, node 1: CPUs 8-15,24-31)")
    assert "cuda:2 (0000:9a:00.0) on node 1" in numa and numa.endswith("host state: node 0")
