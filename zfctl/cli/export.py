"""`zfctl export CKPT_DIR --output DIR`: a Hugging Face save_pretrained folder (safetensors)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer

from zfctl.cli._common import CkptDirArg, ForceOpt, console


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
    from zfctl.train import export as train_export
    from zfctl.train.checkpoint import use_checkpoint_with
    from zfctl.train.weights import EXPORT_MARKER

    # export has no --latest-good: a damaged checkpoint's line names the export of an intact one
    use_checkpoint_with(lambda ckpt: f"zfctl export {shlex.quote(str(ckpt))} --output {shlex.quote(str(output))}"
                        + (" --force" if force else ""))

    path = train_export(ckpt_dir, output, force=force, push_to_hub=push_to_hub)
    written = json.loads((path / EXPORT_MARKER).read_text(encoding="utf-8"))  # what export recorded
    console.print(f"[bold green]exported[/] {_shown(written['checkpoint'])} (step {written['step']}) -> {path}",
                  highlight=False, soft_wrap=True)


def _shown(checkpoint: str) -> str:
    """The checkpoint as `generate` names it: relative to the current folder when it lies under it
    (``runs/demo/checkpoints/step-000118``), else absolute. The export's zfctl-export.json keeps
    the absolute path."""
    try:
        return str(Path(checkpoint).relative_to(Path.cwd().resolve()))
    except ValueError:
        return checkpoint
