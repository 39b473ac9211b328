"""`zfctl resume CKPT_DIR`: continue a run exactly from a checkpoint (or a run folder's newest)."""

from __future__ import annotations

from pathlib import Path

import typer

from zfctl.cli._common import console
from zfctl.errors import UserError


def resume(
    ckpt_dir: Path = typer.Argument(
        ...,
        exists=True,
        metavar="CKPT_DIR",
        help="A checkpoint folder, or a run folder (its newest checkpoint).",
    ),
    max_steps: int | None = typer.Option(
        None, "--max-steps", min=1, help="Train until this total step count (default: the plan's)."
    ),
    allow_changes: bool = typer.Option(
        False, "--allow-changes", help="Accept a plan or world size that differs from the checkpoint's."
    ),
) -> None:
    """Continue a run from CKPT_DIR with the plan saved in it; losses continue identically."""
    from zfctl.plan.render import print_plan

    try:
        from zfctl.train import resume as train_resume
    except ImportError:
        raise UserError("resume is not available yet in this build (zfctl.train.resume is missing)") from None
    # The loop reads the plan from the checkpoint and calls back so it prints before any loading.
    result = train_resume(
        ckpt_dir,
        max_steps=max_steps,
        allow_changes=allow_changes,
        on_plan=lambda plan: print_plan(plan, console),
    )
    console.print(f"[bold green]done[/] {result.steps} steps  ->  {result.output_dir}")
