"""`zfctl resume CKPT_DIR`: continue a run exactly from a checkpoint (or a run folder's newest)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from zfctl.cli._common import CkptDirArg, console
from zfctl.errors import UserError


def resume(
    ckpt_dir: CkptDirArg,
    max_steps: Annotated[
        int | None,
        typer.Option("--max-steps", min=1, help="Train until this total step count (default: the plan's)."),
    ] = None,
    allow_changes: Annotated[
        bool,
        typer.Option(
            "--allow-changes", help="Accept a plan that differs from the checkpoint's (never the world size)."
        ),
    ] = False,
    latest_good: Annotated[
        bool,
        typer.Option(
            "--latest-good",
            help="From a run folder, resume the newest checkpoint whose files match their digests "
            "(skips damaged newer ones).",
        ),
    ] = False,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            min=1,
            help="Processes on this node; default: the checkpoint's world size "
            "(>1 relaunches under torchrun).",
        ),
    ] = None,
) -> None:
    """Continue a run from CKPT_DIR with the plan saved in it; losses continue identically."""
    from zfctl.plan.render import print_plan
    from zfctl.train.dist import dist_env, rank_error, relaunch, under_torchrun, worker_argv

    try:
        from zfctl.train import resume as train_resume
    except ImportError:
        raise UserError("resume is not available yet in this build (zfctl.train.resume is missing)") from None
    if not under_torchrun():
        saved = _saved_world_size(ckpt_dir, latest_good)
        if nproc is not None and saved is not None and nproc != saved:
            # Checked here, before N processes start, rather than by each rank after torchrun
            # formed the group (that ended in a ChildFailedError traceback per rank).
            raise UserError(f"--nproc {nproc}: the checkpoint was written by {saved} process(es) and "
                            "each holds only its share of the host optimizer state (resharding is not "
                            f"supported); resume with --nproc {saved} or leave --nproc out")
        n = nproc if nproc is not None else (saved or 1)
        if n > 1:  # the same world size as the checkpoint
            _check_launch(ckpt_dir, latest_good)
            console.print(f"launching {n} processes under torchrun (standalone)")
            raise typer.Exit(code=relaunch(n, worker_argv(sys.argv[1:])))
    env = dist_env()
    # The loop reads the plan from the checkpoint and calls back so it prints before any loading.
    try:
        result = train_resume(
            ckpt_dir,
            max_steps=max_steps,
            allow_changes=allow_changes,
            on_plan=lambda plan: print_plan(plan, console),
            latest_good=latest_good,
        )
    except Exception as e:  # a user error or a lost peer: one line per rank; a bug: as is
        named = rank_error(e, env)
        if named is e:
            raise
        raise named from None
    if env.is_main:
        console.print(f"[bold green]done[/] {result.steps} steps  ->  {result.output_dir}")


def _saved_world_size(ckpt_dir: Path, latest_good: bool) -> int | None:
    """The world size recorded in the checkpoint; None if it cannot be read (resume reports why)."""
    from zfctl.train.checkpoint import resolve_checkpoint

    try:
        return resolve_checkpoint(ckpt_dir, latest_good=latest_good).world_size
    except UserError:
        return None


def _check_launch(ckpt_dir: Path, latest_good: bool) -> None:
    """Before starting N processes: the run folder is free and writable (rank 0 locks it)."""
    from zfctl.train.checkpoint import resolve_checkpoint
    from zfctl.train.lock import check_free
    from zfctl.writable import check_writable

    run_dir = resolve_checkpoint(ckpt_dir, latest_good=latest_good).path.parent.parent
    check_free(run_dir)
    check_writable(run_dir, "CKPT_DIR", "resume needs to write checkpoints and metrics there")
