"""The zfctl command line: one thin module per verb, registered here.

Each verb module only parses flags, calls into `zfctl.plan` / `zfctl.train` / `zfctl.bench`, and
prints. Engines are imported lazily inside the commands so `zfctl --help` and `zfctl plan` stay
fast and work before the training pieces are built.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from zfctl.cli import bench, doctor, evaluate, export, finetune, generate, plan, presets, resume
from zfctl.cli._common import ZfctlGroup

app = typer.Typer(
    cls=ZfctlGroup,
    name="zfctl",
    help="Fine-tune LLMs with stall-free CPU optimizer offload (ZenFlow, arXiv 2505.12242).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        from zfctl import __version__

        typer.echo(f"zfctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the zfctl version and exit."),
    ] = False,
) -> None:
    """Fine-tune LLMs with stall-free CPU optimizer offload (ZenFlow, arXiv 2505.12242)."""


app.command("finetune")(finetune.finetune)
app.command("resume")(resume.resume)
app.command("bench")(bench.bench)
app.command("plan")(plan.plan)
app.add_typer(presets.app, name="presets")
app.command("export")(export.export)
app.command("generate")(generate.generate)
app.command("evaluate")(evaluate.evaluate)
app.command("doctor")(doctor.doctor)


# The width rich lays out for when stdout is not a terminal (a pipe, a log file, CI): rich's own
# default there is 80, which wraps plan rows, step lines and printed commands mid-word. Lines
# that hold a command or a path are printed with soft_wrap (never wrapped) on top of this.
PIPED_COLUMNS = 200


def main() -> None:
    """Console-script entry point (`zfctl`, `python -m zfctl`)."""
    from zfctl.cli._common import note_line
    from zfctl.cli._threads import drop_bad_omp_threads

    bad_threads = drop_bad_omp_threads()  # before anything loads torch: libgomp reads it as torch loads
    if bad_threads:
        note_line(bad_threads)
    if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        # Every rich Console reads COLUMNS when it sizes itself, those torchrun ranks make too.
        os.environ["COLUMNS"] = str(PIPED_COLUMNS)
    app(prog_name="zfctl")
