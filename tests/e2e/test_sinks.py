"""The optional logging sinks, for real: one tiny run through the CLI with TensorBoard and W&B offline.

Each test reads back what the sink wrote (TensorBoard's own EventAccumulator; the W&B offline
run's record log, parsed into wandb's own protobuf records) and compares it with
``metrics.jsonl``, the record of truth. W&B runs with ``WANDB_MODE=offline`` and its
config/cache folders under tmp_path: no network, nothing written to the home folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zfctl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=64", "data.max_length=64", "train.micro_batch_size=4", "train.eval_batches=1",
    "train.device=cpu", "train.precision=fp32", "train.eval_every=2", "logging.every=1",
    f"train.max_steps={STEPS}", "checkpoint.every=0",
]


def finetune(out: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    sets = [a for s in [*TINY, *extra] for a in ("--set", s)]
    p = subprocess.run([sys.executable, "-m", "zfctl", "finetune", "tiny-llama", "--data", "alpaca-sample",
                        "--output", str(out), *sets], check=False, cwd=ROOT, text=True, capture_output=True,
                       timeout=300,
                       env={**os.environ, "COLUMNS": "200", **(env or {})})
    return p.returncode, p.stdout + p.stderr


def f32(x: float) -> float:
    """What a float32 field holds for ``x`` (TensorBoard stores scalars as float32)."""
    return float(np.float32(x))


@pytest.fixture(scope="module")
def sinks_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run that writes both sinks (each test reads its own): a run's cost is its process
    start-up, not its 3 steps, and neither sink reads what the other writes."""
    sinks = [s for s in ("tensorboard", "wandb") if importlib.util.find_spec(s)]  # both in the dev extra
    tmp = tmp_path_factory.mktemp("sinks")
    out = tmp / "run"
    home = tmp / "wandb-home"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(home / "config"),
           "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"),
           "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off"}
    rc, log = finetune(out, *[f"logging.{s}=true" for s in sinks], "logging.wandb_project=zfctl-test", env=env)
    assert rc == 0, log
    return out


@pytest.mark.slow
def test_tensorboard_events_hold_the_metrics(sinks_run: Path) -> None:
    pytest.importorskip("tensorboard")  # in the dev extra: `make test` always runs this
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = sinks_run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    train = read_metrics(out / "metrics.jsonl", "train")
    evals = read_metrics(out / "metrics.jsonl", "eval")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert len(evals) >= 1
    scalars = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens", "eval/eval_loss"} <= scalars
    for tag, records, key in [("train/loss", train, "loss"), ("train/lr", train, "lr"),
                              ("eval/eval_loss", evals, "eval_loss")]:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in records], tag
        assert [e.value for e in events] == [f32(r[key]) for r in records], tag


@pytest.mark.slow
def test_wandb_offline_run_folder_holds_the_metrics(sinks_run: Path) -> None:
    pytest.importorskip("wandb")  # in the dev extra: `make test` always runs this
    out = sinks_run
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, sorted(p.name for p in (out / "wandb").iterdir())
    logs = list(runs[0].glob("run-*.wandb"))
    assert len(logs) == 1, "the offline run's record log is missing"

    history: dict[int, dict] = {}  # _step -> every key logged at that step
    config: set[str] = set()
    for rec in wandb_records(logs[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "run":
            config |= {i.key for i in rec.run.config.update}
    assert {"model", "data", "train", "zenflow"} <= config  # the resolved plan is the run's config
    train = read_metrics(out / "metrics.jsonl", "train")
    evals = read_metrics(out / "metrics.jsonl", "eval")
    for r in train:  # exactly as logged: W&B keeps JSON doubles
        got = history[r["step"]]
        assert (got["train/loss"], got["train/lr"], got["train/tokens_seen"]) == (
            r["loss"], r["lr"], r["tokens_seen"]), r["step"]
    for r in evals:
        assert history[r["step"]]["eval/eval_loss"] == r["eval_loss"], r["step"]
    assert sorted(history) == sorted({r["step"] for r in train + evals})


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of an offline run's ``run-*.wandb`` file, in order.

    wandb 0.31 ships no Python reader for it (``wandb sync`` reads it in Go). The file is a
    7-byte header (``:W&B``, magic, version), then the LevelDB log format: 32 KiB blocks of
    chunks, each ``crc32c:u32 length:u16 type:u8`` + payload; type 1 is a whole record, 2/3/4
    the first/middle/last piece of one; a block tail shorter than a chunk header is padding.
    Each record is a ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, parts = 7, 32 * 1024, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # padding at the end of a block
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        parts += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST piece
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(parts)
            parts = b""
            yield rec


@pytest.mark.slow
def test_missing_sink_package_is_one_line_with_the_install_command(tmp_path: Path) -> None:
    # A sitecustomize that hides the packages from importlib's finder, as on a fresh install.
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import importlib.util as u\n_find = u.find_spec\n"
        "u.find_spec = lambda name, *a: None if name in ('tensorboard', 'wandb') else _find(name, *a)\n")
    env = {"PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])}
    for sink, needle in [("tensorboard", "pip install tensorboard"), ("wandb", "pip install wandb")]:
        out = tmp_path / sink
        rc, log = finetune(out, f"logging.{sink}=true", env=env)
        lines = [line for line in log.splitlines() if line.startswith("error:")]
        assert rc == 2, log
        assert len(lines) == 1 and needle in lines[0] and f"logging.{sink}=false" in lines[0], log
        assert "Traceback" not in log
        assert not out.exists()  # nothing written
