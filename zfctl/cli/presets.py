"""`zfctl presets ls | show NAME | cp NAME DEST`: the shipped model, data and zenflow presets."""

from __future__ import annotations

import os
import shutil
from dataclasses import MISSING, Field, fields, is_dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from zfctl.cli._common import console
from zfctl.errors import ConfigError, UserError

app = typer.Typer(help="List, show and copy the shipped presets.", no_args_is_help=True)


@app.command("ls")
def ls() -> None:
    """List every preset with its one-line description."""
    from zfctl.plan.presets import KINDS, list_presets

    table = Table(
        title="presets (use: zfctl finetune MODEL --data DATA --zenflow ZENFLOW)", title_justify="left"
    )
    table.add_column("kind", style="magenta")
    table.add_column("name", style="cyan", no_wrap=True)
    table.add_column("description", overflow="fold")
    for kind in KINDS:
        for preset in list_presets(kind):
            table.add_row(kind, preset.name, preset.description)
    console.print(table)


def _section_keys(section: str) -> Table:
    """Every key of a plan section with its default and meaning; a nested section (zenflow.tuning)
    follows under its own heading."""
    from zfctl.plan.coerce import field_types
    from zfctl.plan.schema import SECTIONS

    table = Table(
        title=f"{section}.* keys (set in a preset, --config file or --set {section}.KEY=VALUE)",
        title_justify="left",
    )
    table.add_column("key", style="cyan", no_wrap=True)
    table.add_column("default")
    table.add_column("meaning", overflow="fold")
    nested = []
    for f in fields(SECTIONS[section]):
        tp = field_types(SECTIONS[section])[f.name][0]
        if isinstance(tp, type) and is_dataclass(tp):
            nested.append((f, tp))
        else:
            table.add_row(f"{section}.{f.name}", _default(f), f.metadata.get("help", ""))
    for f, tp in nested:
        table.add_section()
        table.add_row(Text(f.name, style="bold magenta"), "", f.metadata.get("help", ""))
        for sub in fields(tp):
            table.add_row(f"{section}.{f.name}.{sub.name}", _default(sub), sub.metadata.get("help", ""))
    return table


def _default(f: Field) -> str:
    from zfctl.plan.io import to_plain
    from zfctl.plan.render import short_value

    return short_value(to_plain(f.default if f.default is not MISSING else None))


@app.command("show")
def show(
    name: Annotated[
        str,
        typer.Argument(
            metavar="NAME", help="A preset name, or a section (model, data, train, zenflow, ...)."
        ),
    ],
) -> None:
    """Show a preset file with the meaning of each key it sets, or every key of a section."""
    from zfctl.plan.coerce import suggest
    from zfctl.plan.presets import KINDS, find_any, list_presets
    from zfctl.plan.schema import SECTIONS

    if name in SECTIONS:
        console.print(_section_keys(name))
        return
    found = find_any(name)
    if not found:
        names = [p.name for kind in KINDS for p in list_presets(kind)] + list(SECTIONS)
        raise ConfigError(
            "NAME", name, f"no such preset or section{suggest(name, names)}; see `zfctl presets ls`"
        )
    for preset in found:
        console.rule(f"{preset.kind} preset {preset.name}  ({preset.path})")
        console.print(Syntax(preset.path.read_text(encoding="utf-8"), "yaml", background_color="default"))
        for section in preset.load():
            console.print(_section_keys(section))


@app.command("cp")
def cp(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Preset to copy.")],
    dest: Annotated[
        str,
        typer.Argument(
            metavar="DEST",
            help="File or folder to copy it to (edit it, then use --config); a name ending in / is a "
            "folder, created if missing.",
        ),
    ],
    kind: Annotated[
        str | None, typer.Option("--kind", help="model, data or zenflow, if NAME is ambiguous.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Copy a preset file (comments included) to DEST as a starting point for --config."""
    from zfctl.plan.coerce import suggest
    from zfctl.plan.presets import KINDS, find_any, get_preset, list_presets

    if kind is not None and kind not in KINDS:
        raise ConfigError("--kind", kind, f"use one of {', '.join(KINDS)}")
    found = [get_preset(kind, name)] if kind else find_any(name)
    if not found:
        names = [p.name for k in KINDS for p in list_presets(k)]
        raise ConfigError("NAME", name, f"no such preset{suggest(name, names)}; see `zfctl presets ls`")
    if len(found) > 1:
        raise UserError(
            f"NAME {name!r} is a preset of several kinds; pick one with --kind "
            f"({', '.join(p.kind for p in found)})"
        )
    from zfctl.writable import check_writable

    src = found[0].path
    # A trailing slash says "a folder" (pathlib drops it, so look at the text as typed).
    as_folder = dest.endswith(("/", os.sep))
    folder = Path(dest)
    if as_folder and folder.exists() and not folder.is_dir():
        raise UserError(f"DEST {dest}: {folder} is a file, not a folder; drop the trailing / to overwrite "
                        "it (with --force) or choose another DEST")
    target = folder / src.name if as_folder or folder.is_dir() else folder
    if target.is_dir():
        raise UserError(f"DEST {target}: is a folder; give a file name or another folder")
    if target.exists() and not force:
        raise UserError(f"DEST {target}: already exists; pass --force to overwrite it")
    if not as_folder and not target.parent.is_dir():
        raise UserError(f"DEST {target}: folder {target.parent} does not exist; create it, or end DEST "
                        "with / to have it created")
    check_writable(target.parent, "DEST", shown=target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, target)
    console.print(f"copied {src.name} -> {target}  (use it: zfctl finetune ... --config {target})")
