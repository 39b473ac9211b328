"""The light verbs answer without torch: `zfctl --help`, `presets ls/show`, `plan`.

`import torch` alone takes about 2 s of the 2-core machine (transformers and datasets more), so a
verb that only reads YAML or does arithmetic must not load them. Each case runs the verb in a
fresh interpreter and lists the heavy modules it left in ``sys.modules``: timings would be flaky,
the module list is not. `zfctl doctor` is not here: proving that torch loads is its job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zfctl.gpu_probe import DRIVER_NODES, no_cuda_reason

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "datasets", "safetensors", "numpy")

# Runs the CLI in-process, then prints which of HEAVY got imported (stdout of the verb itself goes
# to a pipe; the last line is ours).
PROBE = f"""
import json, sys
from zfctl.cli import main
sys.argv = ["zfctl", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
print("\\nHEAVY " + json.dumps({{"code": code, "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def heavy_modules(args: list[str], tmp_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZFCTL_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True,
                         check=False, env=env, cwd=tmp_path, timeout=120)
    last = out.stdout.rstrip().rsplit("\n", 1)[-1]
    assert last.startswith("HEAVY "), out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(last.removeprefix("HEAVY "))


LIGHT = {
    "help": ["--help"],
    "finetune-help": ["finetune", "--help"],
    "presets-ls": ["presets", "ls"],
    "presets-show": ["presets", "show", "tiny-llama"],
    "presets-show-section": ["presets", "show", "zenflow"],
}


@pytest.mark.parametrize("args", LIGHT.values(), ids=LIGHT.keys())
def test_light_verb_imports_no_torch(args: list[str], tmp_path: Path) -> None:
    got = heavy_modules(args, tmp_path)
    assert got["code"] in (0, None), got
    assert got["loaded"] == [], f"zfctl {' '.join(args)} imported {got['loaded']}"


@pytest.mark.skipif(no_cuda_reason() is None, reason="a GPU driver is loaded here: plan asks torch about it")
@pytest.mark.parametrize("args", [
    ["plan", "tiny-llama", "--data", "alpaca-sample"],
    ["plan", "tiny-llama", "--data", "chat-sample", "--json"],
    ["plan", "llama2-7b", "--data", "alpaca", "--gpu-memory", "80GB", "--host-memory", "128GB"],
], ids=["tiny", "chat-json", "7b-target"])
def test_plan_imports_no_torch_without_a_gpu_driver(args: list[str], tmp_path: Path) -> None:
    """A plan whose model shapes come from a Llama config needs arithmetic only; where no GPU
    driver is loaded, CUDA's absence is known without torch (zfctl/gpu_probe.py)."""
    got = heavy_modules(args, tmp_path)
    assert got["code"] in (0, None), got
    assert got["loaded"] == [], f"zfctl {' '.join(args)} imported {got['loaded']}"


def test_gpu_probe_reads_driver_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if not sys.platform.startswith("linux"):
        pytest.skip("device nodes are read on Linux only")
    assert no_cuda_reason(tmp_path) is not None  # an empty root: no driver
    for node in DRIVER_NODES:
        root = tmp_path / node.replace("/", "_")
        (root / node).parent.mkdir(parents=True)
        (root / node).touch()
        assert no_cuda_reason(root) is None, node  # a driver: torch must be asked
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert no_cuda_reason(root) == "CUDA_VISIBLE_DEVICES is empty"
