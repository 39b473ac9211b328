"""Metrics: one JSON line per optimizer step and per evaluation, plus optional W&B/TensorBoard.

``metrics.jsonl`` is the record of truth (the console line is a view of it). Records carry a
``kind`` ("train" or "eval") and the optimizer ``step`` they belong to. A resumed run first drops
the records written after its checkpoint, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from zfctl.errors import RunFailed, UserError
from zfctl.plan.io import atomic_write_text
from zfctl.plan.schema import RunPlan
from zfctl.writable import os_error_line

if TYPE_CHECKING:
    from zfctl.train.progress import StepResult

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"  # event files, under the run folder
WANDB_DIR = "wandb"  # made by wandb.init(dir=run folder) itself; named here for --force


class Sink(Protocol):
    """Something that accepts metric records (W&B, TensorBoard)."""

    def log(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class _TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self._w = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        prefix = record.get("kind", "train")
        for k, v in record.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                self._w.add_scalar(f"{prefix}/{k}", v, record["step"])

    def close(self) -> None:
        self._w.close()


class _WandbSink:
    def __init__(self, project: str, run_dir: Path, config: dict) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=project, dir=str(run_dir), config=config, resume="allow")

    def log(self, record: dict[str, Any]) -> None:
        prefix = record.get("kind", "train")
        data = {f"{prefix}/{k}": v for k, v in record.items() if k not in ("kind", "step")}
        self._run.log(data, step=record["step"])

    def close(self) -> None:
        self._run.finish()


def _clean(v: Any) -> Any:
    # JSON has no NaN/inf; keep them readable rather than crash the run on a diverging loss.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsWriter:
    """Appends metric records to ``OUTPUT/metrics.jsonl`` and forwards them to optional sinks."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None,
                 sinks: list[Sink] | None = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.dropped = truncate_after(self.path, resume_step) if resume_step is not None else 0
        # Line-buffered: each record reaches the OS as soon as it is written, so a killed run
        # keeps every step it finished (one small write syscall per step).
        self._f = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (open for the run)
        self._sinks = sinks or []

    def log(self, record: dict[str, Any], *, sinks: bool = True) -> None:
        """Append ``record``; ``sinks``: forward it to W&B/TensorBoard too (numbers; not a
        sample's texts)."""
        try:
            self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        except OSError as e:
            # A write() error carries no file name (a disk another process filled after the
            # space check): name the file here, and say how the run continues.
            raise RunFailed(f"cannot append to {self.path}: {os_error_line(e)}; the run stopped; free space "
                            f"there, then continue from the newest checkpoint with `zfctl resume {self.path.parent}`"
                            ) from None
        for s in self._sinks if sinks else ():
            s.log(record)

    def close(self) -> None:
        if not self._f.closed:
            with contextlib.suppress(OSError):  # the buffered tail of a failed write fails again: said once, in log()
                self._f.close()
        for s in self._sinks:
            s.close()
        self._sinks = []


def truncate_after(path: Path, step: int) -> int:
    """Drop the records of steps after ``step`` (written by the run after its last checkpoint), and
    lines that are no record: a torn last line from a killed process, bytes that are not UTF-8
    JSON (damaged on disk). Returns how many such lines were dropped. The file is replaced
    atomically (a temporary file renamed): a reader sees the old or the new one, never half."""
    if not path.exists():
        return 0
    keep, unreadable = [], 0
    for raw in path.read_bytes().splitlines():
        try:
            if int(json.loads(raw)["step"]) <= step:  # json.loads decodes the bytes as UTF-8
                keep.append(raw.decode("utf-8"))
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
            unreadable += bool(raw.strip())
    atomic_write_text(path, "".join(line + "\n" for line in keep))
    return unreadable


def read_metrics(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """All records of ``path`` (optionally of one kind), in file order."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out


def require_sinks(*, wandb: bool, tensorboard: bool) -> None:
    """Fail before any work (and before the output folder is touched) if a sink's package is missing."""
    import importlib.util

    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise _missing("tensorboard")
    if wandb and importlib.util.find_spec("wandb") is None:
        raise _missing("wandb")


def _missing(sink: str) -> UserError:
    """The one line for a sink whose package is not installed: what to install, or how to turn it off."""
    what = {"tensorboard": "TensorBoard", "wandb": "Weights & Biases"}[sink]
    return UserError(f"logging.{sink}=true needs {what}: pip install {sink} (or set logging.{sink}=false)")


def build_sinks(*, wandb: bool, wandb_project: str, tensorboard: bool, run_dir: Path,
                config: dict) -> list[Sink]:
    """Open the optional sinks; a missing package is a UserError before any training starts."""
    sinks: list[Sink] = []
    if tensorboard:
        try:
            sinks.append(_TensorBoardSink(Path(run_dir) / TENSORBOARD_DIR))
        except ImportError:
            raise _missing("tensorboard") from None
    if wandb:
        try:
            sinks.append(_WandbSink(wandb_project, Path(run_dir), config))
        except ImportError:
            raise _missing("wandb") from None
    return sinks


def open_metrics(plan: RunPlan, run_dir: Path, *, resume_step: int | None,
                 note: Callable[[str], None] | None = None) -> MetricsWriter:
    """Rank 0's ``metrics.jsonl`` with the sinks ``plan.logging`` asks for. ``resume_step``: a
    resumed run drops the records after its checkpoint's step (a crashed run wrote them), and
    lines that are no record, which ``note`` is told of."""
    log = plan.logging
    sinks = build_sinks(wandb=log.wandb, wandb_project=log.wandb_project, tensorboard=log.tensorboard,
                        run_dir=run_dir, config=asdict(plan))
    writer = MetricsWriter(run_dir, resume_step=resume_step, sinks=sinks)
    if writer.dropped and note is not None:
        note(f"{writer.path}: {writer.dropped} line(s) that are no record (torn by a kill, or bytes that are not "
             "UTF-8 JSON) were dropped; the others are kept")
    return writer


def train_record(step: int, s: StepResult, *, tokens_seen: int, compute_ms: float, epoch: int,
                 device: torch.device, world_size: int) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of optimizer step ``step`` (``kind: train``), which reported
    ``s``; ``compute_ms`` is its forward and backward passes (:class:`StepTimer`)."""
    stats, step_ms = s.stats, s.step_ms
    rec = {"kind": "train", "step": step, "loss": s.loss, "lr": s.lr,
           "tokens": s.tokens, "tokens_seen": tokens_seen,
           "tokens_per_s": s.tokens / max(step_ms, 1e-6) * 1e3,
           "step_ms": step_ms, "compute_ms": compute_ms,
           "device_opt_ms": stats.device_opt_ms, "stall_ms": stats.stall_ms,
           # share of the step the device had work: fwd/bwd + device optimizer
           "gpu_busy": min(1.0, (compute_ms + stats.device_opt_ms) / max(step_ms, 1e-6)),
           "cpu_step_ms": stats.cpu_step_ms, "boundary": stats.boundary,
           "selection": stats.selection, "warmup": stats.warmup,
           "skipped": stats.skipped, "selected_fraction": stats.selected_fraction,
           "grad_norm": stats.grad_norm, "loss_scale": stats.loss_scale,
           "update_interval": stats.update_interval, "d2h_bytes": stats.d2h_bytes,
           "h2d_bytes": stats.h2d_bytes, "epoch": epoch,
           **memory_stats(device)}
    if stats.select_stay is not None:  # a selection after the first: the share of device columns kept
        rec["select_stay"] = stats.select_stay
    if world_size > 1:  # bytes rank 0 sent to the group (StepStats.comm_bytes)
        rec["comm_bytes"] = stats.comm_bytes
    return rec


class StepTimer:
    """Wall-clock milliseconds of a code span, exact on the device without extra syncs.

    On CUDA a pair of events brackets the span and is read later, after the step has synced
    anyway (the loss ``.item()``), so timing adds no sync point. On CPU perf_counter is exact.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._t0 = self._t1 = 0.0
        if self._cuda:
            self._e0 = torch.cuda.Event(enable_timing=True)
            self._e1 = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self._cuda:
            self._e0.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            self._e1.record()
        else:
            self._t1 = time.perf_counter()

    def ms(self) -> float:
        """Elapsed ms; on CUDA call it only after the stream passed ``stop`` (it would block)."""
        if self._cuda:
            return float(self._e0.elapsed_time(self._e1))
        return (self._t1 - self._t0) * 1e3


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak device memory (CUDA) and peak host RSS, in GiB."""
    out = {"host_peak_gib": peak_rss_bytes() / 2**30}
    if device.type == "cuda":
        out["device_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set: ``VmHWM`` of its own address space on Linux. Not
    ``ru_maxrss``, which Linux carries over ``exec`` from the address space a process replaced, so
    a run started by a large process would report at least that process's RSS; ``ru_maxrss`` is
    the fallback where /proc is missing (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
