"""`zfctl export CKPT_DIR --output DIR`: a Hugging Face save_pretrained folder (safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zfctl.cli._common import CkptDirArg, ForceOpt, console
from zfctl.errors import UserError


def export(
    ckpt_dir: CkptDirArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write (model + tokenizer).")],
    force: ForceOpt = False,
    push_to_hub: Annotated[
        str | None,
        typer.Option(
            "--push-to-hub", metavar="REPO", help="Also upload to this hub repo (needs network and a token)."
        ),
    ] = None,
) -> None:
    """Write a folder that transformers' AutoModelForCausalLM.from_pretrained loads."""
    try:
        from zfctl.train import export as train_export
    except ImportError:
        raise UserError("export is not available yet in this build (zfctl.train.export is missing)") from None
    path = train_export(ckpt_dir, output, force=force, push_to_hub=push_to_hub)
    console.print(f"[bold green]exported[/] {path}")
