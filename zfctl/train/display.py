"""The console view of a run: a rich progress bar with ETA and one dense line per interval.

Only rank 0 draws (the others get :class:`NullDisplay`). The line is a view of the same record
that goes to ``metrics.jsonl``, formatted by :func:`format_train_line`, e.g.::

    step   40/200 | loss 3.4121 (avg 10) | lr 2.00e-04 | 5.3k tok/s | 182 ms = fwd/bwd 150 + opt 20 + stall 12 (busy 93%) | sel 0.10 stay 0.55 | host 1.2G

``step ms`` is the wall time of the whole optimizer step; ``fwd/bwd`` is device compute
(forward + backward of all micro-batches), ``opt`` the device-side optimizer work, ``stall`` every
host wait inside ``step()`` (gradient D2H and accumulation, the CPU worker, installs); what remains
is data loading and host overhead. ``busy`` = (fwd/bwd + opt) / step ms: the device's share.
``stay``: on the first line after a selection (not the run's first), the share of the device's
columns that stayed on the device (``select_stay`` in the record of the selection step).
"""

from __future__ import annotations

from typing import Any, Protocol

# What the dense line's fields mean, printed above the first line of a run folder's first run (a
# resume's, too, with --verbose; RichDisplay's ``legend``), and kept in the README's finetune
# section and `zfctl finetune --help` (tests/cli/test_newcomer_cli.py checks them).
STEP_LINE_LEGEND = (
    "step line: loss = train loss, the mean since the last line (avg N) | lr = learning rate | tok/s = "
    "tokens per second | ms = the whole step: fwd/bwd (device forward + backward) + opt (device "
    "optimizer) + stall (host waits inside the step: gradient copies, the CPU update, installs); busy = "
    "the device's share | cpu-adam = ms of the CPU AdamW update that finished this step | sel = share of "
    "weights updated on the device every step (0.00 during zenflow.full_warm_up_rounds: synchronous full CPU-offload steps); "
    "stay = share of the device's columns kept at the last selection (shown once after each, from the second on) | "
    "gnorm = gradient L2 norm before clipping | host/dev = peak memory, GiB")

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class Display(Protocol):
    """What the loop calls; a rich implementation on rank 0, a no-op elsewhere."""

    def start(self, total_steps: int, start_step: int) -> None: ...

    def step(self, rec: dict[str, Any], *, line: bool) -> None:
        """A step's metrics record: the bar moves; ``line``: the dense line is printed too, its
        loss the mean over the steps since the previous line."""

    def print(self, text: str) -> None: ...
    def close(self) -> None: ...


def _si(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def format_train_line(rec: dict[str, Any], total_steps: int) -> str:
    """One dense line from a ``kind == "train"`` metrics record."""
    width = len(str(total_steps))
    split = (f"{rec['step_ms']:.0f} ms = fwd/bwd {rec['compute_ms']:.0f} + opt {rec['device_opt_ms']:.0f}"
             f" + stall {rec['stall_ms']:.0f}")
    if rec.get("gpu_busy") is not None:
        split += f" (busy {100 * rec['gpu_busy']:.0f}%)"
    n = rec.get("loss_steps", 1)  # the console shows the mean over the steps since its last line
    loss = f"loss {rec['loss']:.4f}" + (f" (avg {n})" if n > 1 else "")
    parts = [f"step {rec['step']:>{width}}/{total_steps}", loss,
             f"lr {rec['lr']:.2e}", f"{_si(rec['tokens_per_s'])} tok/s", split]
    if rec.get("cpu_step_ms"):
        parts.append(f"cpu-adam {rec['cpu_step_ms']:.0f} ms")
    if rec.get("selected_fraction") is not None:
        sel = f"sel {rec['selected_fraction']:.2f}"
        if rec.get("select_stay") is not None:
            sel += f" stay {rec['select_stay']:.2f}"
        parts.append(sel)
    if rec.get("grad_norm") is not None:
        parts.append(f"gnorm {rec['grad_norm']:.3g}")
    if rec.get("loss_scale") is not None:
        parts.append(f"scale {rec['loss_scale']:.0f}")
    if rec.get("skipped"):
        parts.append("SKIPPED (fp16 overflow)")
    mem = f"host {rec['host_peak_gib']:.1f}G"
    if rec.get("device_peak_gib") is not None:
        mem = f"dev {rec['device_peak_gib']:.1f}G " + mem
    parts.append(mem)
    return " | ".join(parts)


def note_line(line: str) -> None:
    """One ``note:`` line on stderr (yellow): what the run decided or adjusted on its own."""
    Console(stderr=True).print(f"note: {line}", style="yellow", highlight=False, markup=False, soft_wrap=True)


def format_eval_line(step: int, eval_loss: float, total_steps: int) -> str:
    width = len(str(total_steps))
    return f"step {step:>{width}}/{total_steps} | eval loss {eval_loss:.4f}"


class RichDisplay:
    """Progress bar (steps, elapsed, ETA, last loss) with lines printed above it. ``legend``:
    :data:`STEP_LINE_LEGEND` above them (~600 characters: once per run folder, not on every resume)."""

    def __init__(self, console: Console | None = None, *, legend: bool = True) -> None:
        self.console = console or Console()
        self._legend = legend
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._total = 0
        self._window: list[float] = []  # losses since the last line: the line shows their mean
        self._stay: float | None = None  # the last selection's share of device columns kept, since the last line

    def start(self, total_steps: int, start_step: int) -> None:
        self._total = total_steps
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            TextColumn("{task.fields[loss]}"), console=self.console, transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, loss="")
        self._progress.start()
        if self._legend:
            self._progress.console.print(STEP_LINE_LEGEND, style="dim", highlight=False, soft_wrap=True)

    def step(self, rec: dict[str, Any], *, line: bool) -> None:
        self._window.append(rec["loss"])
        if rec.get("select_stay") is not None:
            self._stay = rec["select_stay"]
        if line:
            window = self._window
            self.print(format_train_line({**rec, "loss": sum(window) / len(window), "loss_steps": len(window),
                                          "select_stay": self._stay}, self._total))
            window.clear()
            self._stay = None
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=rec["step"], loss=f"loss {rec['loss']:.4f}")

    def print(self, text: str) -> None:
        # Printed through the progress' console so the bar stays below the scrolling lines.
        # soft_wrap: a dense line stays one line in logs (a non-terminal console is 80 wide).
        (self._progress.console if self._progress else self.console).print(text, highlight=False,
                                                                           soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class NullDisplay:
    """For ranks other than 0: the loop calls the same methods, nothing is drawn."""

    def start(self, total_steps: int, start_step: int) -> None:
        pass

    def step(self, rec: dict[str, Any], *, line: bool) -> None:
        pass

    def print(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass
