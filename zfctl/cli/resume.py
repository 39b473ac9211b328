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
            "--allow-changes", help="Accept a plan that differs from the checkpoint's."
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
            "(>1 relaunches under torchrun). Another count re-cuts the optimizer state and keeps the "
            "global batch by changing train.gradient_accumulation_steps.",
        ),
    ] = None,
) -> None:
    """Continue a run from CKPT_DIR with the plan saved in it; losses continue identically."""
    from zfctl.plan.render import print_plan
    from zfctl.train.dist import bind_to_launcher, dist_env, rank_error, relaunch, under_torchrun, worker_argv

    bind_to_launcher()  # a rank of an --nproc job dies with it, even when the launcher is SIGKILLed

    try:
        from zfctl.train import resume as train_resume
    except ImportError:
        raise UserError("resume is not available yet in this build (zfctl.train.resume is missing)") from None
    if not under_torchrun():
        saved = _saved_world_size(ckpt_dir, latest_good, nproc)
        n = nproc if nproc is not None else (saved or 1)
        if n > 1:
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


def _saved_world_size(ckpt_dir: Path, latest_good: bool, nproc: int | None) -> int | None:
    """The world size recorded in the checkpoint; None if it cannot be read (resume reports why).

    ``nproc`` different from it: checked here, before N processes start, that the global batch can
    be kept (zfctl/train/world_size.py), rather than by each rank after torchrun formed the group.
    """
    from zfctl.plan.io import load_plan_yaml
    from zfctl.train.checkpoint import PLAN_FILE, resolve_checkpoint
    from zfctl.train.world_size import fit_world_size

    try:
        info = resolve_checkpoint(ckpt_dir, latest_good=latest_good)
        plan = load_plan_yaml(info.path / PLAN_FILE) if nproc not in (None, info.world_size) else None
    except UserError:
        return None
    if plan is not None and nproc is not None:
        try:
            fit_world_size(plan, info.world_size, nproc)
        except UserError as e:
            raise UserError(f"--nproc {nproc}: {e}") from None
    return info.world_size


def _check_launch(ckpt_dir: Path, latest_good: bool) -> None:
    """Before starting N processes: the run folder is free and writable (rank 0 locks it)."""
    from zfctl.train.checkpoint import resolve_checkpoint
    from zfctl.train.lock import check_free
    from zfctl.writable import check_writable

    run_dir = resolve_checkpoint(ckpt_dir, latest_good=latest_good).path.parent.parent
    check_free(run_dir)
    check_writable(run_dir, "CKPT_DIR", "resume needs to write checkpoints and metrics there")
