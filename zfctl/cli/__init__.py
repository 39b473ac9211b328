"""The zfctl command line: one thin module per verb, registered here.

Each verb module only parses flags, calls into `zfctl.plan` / `zfctl.train` / `zfctl.bench`, and
prints. Engines are imported lazily inside the commands so `zfctl --help` and `zfctl plan` stay
fast and work before the training pieces are built.
"""

from __future__ import annotations

from typing import Annotated

import typer

from zfctl.cli import bench, doctor, export, finetune, plan, presets, resume
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
app.command("doctor")(doctor.doctor)


def main() -> None:
    """Console-script entry point (`zfctl`, `python -m zfctl`)."""
    app(prog_name="zfctl")
