"""What every verb shares: the consoles, the user-error boundary, the plan-resolution options.

User mistakes raise `zfctl.errors.UserError` anywhere below the CLI; `ZfctlGroup.invoke` turns
them into one red line on stderr and exit code 2 (no traceback). So does an `OSError` (a write to
a read-only, forbidden or full place: its path and errno meaning), except a closed pipe on stdout,
which ends the verb quietly. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import click
import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

from zfctl.errors import UserError

if TYPE_CHECKING:  # the click that Typer's classes are typed against (vendored in recent Typer)
    from typer._click.core import Context as ClickContext

# The parser's error class: recent Typer vendors click as typer._click, older Typer uses the
# click package; catch whichever this install raises.
try:
    from typer._click.exceptions import UsageError as _VendoredUsageError
except ImportError:
    _VendoredUsageError = click.UsageError  # type: ignore[misc,assignment]
USAGE_ERRORS: tuple[type[Exception], ...] = tuple({click.UsageError, _VendoredUsageError})

_PADDING = re.compile(r"[ \t]+\n")


class UnpaddedConsole(Console):
    """A rich Console that drops the spaces at the end of each line when its output is not a
    terminal (a pipe, a log file). rich pads every row of a table to the table's width: a log of
    `zfctl finetune` had each plan line padded to 120 columns with spaces. Off a terminal rich
    writes no escape codes, so the spaces before a newline are padding and nothing else."""

    def _render_buffer(self, buffer: Any) -> str:  # rich's one place that turns segments into text
        text = super()._render_buffer(buffer)
        return text if self.is_terminal else _PADDING.sub("\n", text)


console = UnpaddedConsole()
err_console = UnpaddedConsole(stderr=True)


def error_line(message: str) -> None:
    """One red line on stderr (rich markup off: messages hold user text like '[0, 1]')."""
    err_console.print(Text(f"error: {message}", style="bold red"), soft_wrap=True)


def warning_line(message: str) -> None:
    """A yellow ``warning: ...`` line on stderr: the run goes on, but the user should know."""
    err_console.print(Text(f"warning: {message}", style="yellow"), soft_wrap=True)


def note_line(message: str) -> None:
    """One yellow informational line on stderr."""
    err_console.print(Text(f"note: {message}", style="yellow"), soft_wrap=True)


def usage_error_line(e: Exception) -> None:
    """A parser error (bad flag value, missing path, unknown option) as one `error:` line."""
    ctx = getattr(e, "ctx", None)
    cmd = ctx.command_path if ctx is not None else "zfctl"
    message = e.format_message() if isinstance(e, (click.UsageError, _VendoredUsageError)) else str(e)
    error_line(f"{message.rstrip('.')}; see `{cmd} --help`")


class ZfctlGroup(TyperGroup):
    """The root command group: UserError and the parser's errors become one `error: ...` line.

    Exit code 2 for both (a RunFailed carries 1). Click raises UsageError while parsing a
    subcommand's flags inside ``invoke`` and the root's own in ``make_context``; Typer would
    otherwise draw them as a framed box.
    """

    def get_command(self, ctx: ClickContext, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _bare_flags(command)
        return command

    def get_params(self, ctx: ClickContext) -> list[Any]:
        return _flag_metavars(super().get_params(ctx))

    def make_context(self, info_name: str | None, args: list[str], parent: ClickContext | None = None,
                     **extra: Any) -> ClickContext:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except USAGE_ERRORS as e:
            if _is_bare_group(e):  # `zfctl` alone: Typer printed the help already; nothing was wrong
                raise typer.Exit(code=0) from None
            usage_error_line(e)
            raise typer.Exit(code=2) from None

    def invoke(self, ctx: ClickContext) -> Any:
        try:
            return super().invoke(ctx)
        except UserError as e:
            error_line(str(e))
            raise typer.Exit(code=getattr(e, "exit_code", 2)) from None
        except BrokenPipeError:
            # The reader went away (`zfctl plan --json | head`): not the user's mistake and no
            # `error:` line. Typer's main silences stdout and exits 1, as rich does for the writes
            # it makes itself and as Python's docs advise ("Note on SIGPIPE").
            raise
        except OSError as e:  # the disk, not the code: a full, read-only or forbidden path
            from zfctl.writable import os_error_line

            error_line(os_error_line(e))
            raise typer.Exit(code=2) from None
        except USAGE_ERRORS as e:
            if _is_bare_group(e):  # `zfctl presets` alone: its help, printed already
                raise typer.Exit(code=0) from None
            usage_error_line(e)
            raise typer.Exit(code=2) from None


def _is_bare_group(e: Exception) -> bool:
    """A command group called without a command: click's no_args_is_help "error", whose message
    is the help text (Typer's rich help prints it itself and leaves the message empty)."""
    return type(e).__name__ == "NoArgsIsHelpError"


def _flag_metavars(params: list[Any]) -> list[Any]:
    """A boolean flag takes no value, so its help shows none: Typer would print `--force <bool>`.
    An empty metavar is what Typer's help then shows in the type column (typer/core.py,
    ``display_type_rich``)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


def _bare_flags(command: Any) -> None:
    """``_flag_metavars`` for a subcommand's parameters (its --help option is made on request),
    and through a nested group (``presets``) for its subcommands."""
    if getattr(command, "_zfctl_bare_flags", False):  # get_command is asked more than once
        return
    get_params = command.get_params
    command.get_params = lambda ctx: _flag_metavars(get_params(ctx))
    command._zfctl_bare_flags = True
    for sub in getattr(command, "commands", {}).values():  # a nested group's subcommands
        _bare_flags(sub)


def plan_flags(output: str | Path | None, max_steps: int | None, nproc: int | None = None, *,
               gpu_memory: str | None = None, host_memory: str | None = None, nodes: int | None = None,
               gpus_per_node: int | None = None) -> dict:
    """The dedicated flags as a plan fragment; they win over --set (applied last)."""
    from zfctl.plan.memory import parse_size

    flags: dict = {}
    for flag, key, value in (("--gpu-memory", "gpu_memory", gpu_memory), ("--host-memory", "host_memory", host_memory)):
        if value is not None:
            parse_size(value, flag)  # one line naming the flag as typed, before anything resolves
            flags.setdefault("machine", {})[key] = value.strip()
    if output is not None:
        if not str(output).strip():  # Path("") would be ".": the current folder, never what was meant
            raise UserError("--output '': the run folder is empty; give a folder, e.g. --output runs/my-run")
        flags.setdefault("checkpoint", {})["output_dir"] = str(output)
    if max_steps is not None:
        flags.setdefault("train", {})["max_steps"] = max_steps
    if nproc is not None:
        flags.setdefault("distributed", {})["nproc"] = nproc
    if gpus_per_node is not None:  # the planning name of nproc (processes per node)
        flags.setdefault("distributed", {})["nproc"] = gpus_per_node
    if nodes is not None:
        flags.setdefault("distributed", {})["nodes"] = nodes
    return flags


def resolve_from_cli(
    model: str,
    data: str,
    zenflow: str | None,
    config: Path | list[Path] | None,
    overrides: list[str],
    flags: dict,
    *,
    quiet: bool = False,
):
    """resolve_plan plus printing the notes it collected (ignored DeepSpeed keys)."""
    from zfctl.plan import resolve_plan

    if not data.strip():  # Path("") is ".": the current folder, never what was meant
        raise UserError("--data '': no data given; give a data preset (`zfctl presets ls`, e.g. alpaca-sample) "
                        "or a local .json/.jsonl/.csv/.parquet file")
    if isinstance(config, list):  # --config is repeatable only so that a second one is not dropped silently
        if len(config) > 1:
            raise UserError(f"--config was given {len(config)} times ({', '.join(map(str, config))}); give one "
                            "file (put the keys of both in it, or pass single keys with --set)")
        config = config[0] if config else None
    notes: list[str] = []
    plan = resolve_plan(
        model, data, zenflow=zenflow, config=config, overrides=overrides, flags=flags, notes=notes
    )
    if not quiet:
        for note in notes:
            note_line(note)
    return plan, notes


def print_run_plan(plan: Any, *, verbose: bool = False, holds_all: str = "plan.yaml in the run folder holds all") -> None:
    """The plan at the start of `finetune` and `resume` (and under `zfctl plan`'s verdict): every
    key with ``--verbose`` (zfctl/quiet.py), else the brief (zfctl/plan/brief.py), so the first
    step line is on the first screen. ``holds_all``: where every key is either way (the run
    folder's plan.yaml; `zfctl plan --json`)."""
    from zfctl.quiet import is_verbose

    if verbose or is_verbose():
        from zfctl.plan.render import print_plan

        print_plan(plan, console)
        return
    from zfctl.plan.brief import brief_lines

    console.print(Text("run plan", style="bold") + Text(" (the keys that matter and every key changed from "
                                                         f"its default; --verbose prints all, {holds_all})",
                                                         style="dim"), soft_wrap=True)
    for line in brief_lines(plan):
        section, rest = line.split(": ", 1)
        console.print(Text(f"  {section}: ", style="bold magenta") + Text(rest), soft_wrap=True, highlight=False)


def dumps_json(obj: object) -> str:
    """Stable, readable JSON for --json outputs."""
    return json.dumps(obj, indent=2, sort_keys=False, default=str)


# Options shared by `finetune` and `plan` (same names, same help). Every verb declares its
# parameters as `name: Annotated[type, typer.Option(...)] = default`: the type and the flag
# together, the default where Python puts defaults.
ModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL", help="Model preset (zfctl presets ls), hub id org/name, or local HF folder."
    ),
]
DataOpt = Annotated[
    str,
    typer.Option(
        "--data", "-d", help="Data preset, local .json/.jsonl/.csv/.parquet file, or hub dataset id."
    ),
]
ZenflowOpt = Annotated[
    str | None,
    typer.Option("--zenflow", "-z", help="ZenFlow preset: default, paper, aggressive, zero-offload, off."),
]
ConfigOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--config", "-c", metavar="FILE",
        help="YAML plan fragment or DeepSpeed JSON config, layered over the presets.",
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override one option, e.g. --set train.lr=1e-4 (repeatable; YAML values).",
    ),
]
# A string, not a Path: Path("") is "." and an empty --output must be refused, not mean the current folder.
OutputOpt = Annotated[str | None, typer.Option("--output", "-o", metavar="PATH",
                                               help="Run folder (checkpoint.output_dir).")]
MaxStepsOpt = Annotated[
    int | None, typer.Option("--max-steps", min=1, help="Stop after N optimizer steps (train.max_steps).")
]
CkptDirArg = Annotated[
    Path,
    typer.Argument(
        exists=True, metavar="CKPT_DIR", help="A checkpoint folder, or a run folder (its newest checkpoint)."
    ),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing, non-empty output folder.")]
GpuMemoryOpt = Annotated[
    str | None,
    typer.Option("--gpu-memory", metavar="SIZE",
                 help="Plan for a GPU of this memory, e.g. 80GB (machine.gpu_memory); default: the detected one."),
]
HostMemoryOpt = Annotated[
    str | None,
    typer.Option("--host-memory", metavar="SIZE",
                 help="Plan for this much host RAM, e.g. 128GB (machine.host_memory); default: this machine's."),
]
NodesOpt = Annotated[
    int | None,
    typer.Option("--nodes", min=1, help="Plan for this many nodes (distributed.nodes): per-GPU and per-node lines."),
]
GpusPerNodeOpt = Annotated[
    int | None,
    typer.Option("--gpus-per-node", min=1, help="Plan for this many GPUs (processes) per node (distributed.nproc)."),
]
VerboseOpt = Annotated[
    bool,
    typer.Option("--verbose", help="Show the whole plan and what the libraries print too: progress bars, "
                 "torchrun's banner, known harmless warnings (hidden by default)."),
]
FitOpt = Annotated[
    bool,
    typer.Option("--fit", help="When the plan does not fit the machine, apply the cheapest changes that make it "
                 "fit (a leaner gradient layout, activation checkpointing, accumulate, micro-batch, topk_ratio down to "
                 "0.05, max_length); "
                 "an error when nothing does."),
]
