"""`zfctl resume CKPT_DIR`: continue a run exactly from a checkpoint (or a run folder's newest)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from zfctl.cli._common import CkptDirArg, VerboseOpt, console, note_line, print_run_plan
from zfctl.errors import UserError


def resume(
    ckpt_dir: CkptDirArg,
    max_steps: Annotated[
        int | None,
        typer.Option("--max-steps", min=1, help="Train until this total step count (default: the plan's). "
                     "Moving the end of a cosine or linear LR schedule changes the LR of every later step: "
                     "refused unless --allow-changes (then the schedule is stretched to the new end)."),
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
    strategy: Annotated[
        str | None,
        typer.Option(
            "--strategy",
            help="distributed.strategy to continue under (zero2 or fsdp); default: the checkpoint's. "
            "The model and optimizer state are re-cut; fsdp needs a world size that divides the "
            "sharded dims.",
        ),
    ] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Continue a run from CKPT_DIR with the plan saved in it; losses continue identically."""
    from zfctl.train.world_size import STRATEGIES

    if strategy is not None and strategy not in STRATEGIES:  # before the checkpoint is even read
        raise UserError(f"--strategy {strategy}: use one of {', '.join(STRATEGIES)}")
    from zfctl.quiet import set_verbose

    set_verbose(verbose)  # before transformers loads: its bars read the environment once
    from zfctl.train.dist import bind_to_launcher, dist_env

    bind_to_launcher()  # a rank of an --nproc job dies with it, even when the launcher is SIGKILLed
    from zfctl.train.checkpoint import resume_with, use_checkpoint_with
    from zfctl.train.launch import Launched
    from zfctl.train.launch import resume as start

    use_checkpoint_with(resume_with)  # a damaged checkpoint's line: resume an intact one, or --latest-good
    # The plan is read from the checkpoint and printed through the callback, before any loading.
    result = start(ckpt_dir, max_steps=max_steps, allow_changes=allow_changes, latest_good=latest_good,
                   nproc=nproc, argv=sys.argv[1:], show_plan=print_run_plan,
                   strategy=strategy)
    if isinstance(result, Launched):
        raise typer.Exit(code=result.code)
    from zfctl.plan.io import load_plan_yaml
    from zfctl.train.checkpoint import PLAN_FILE

    if not dist_env().is_main:
        return
    if result.already_finished and result.last_checkpoint is not None:
        from zfctl.cli.finetune import further_command, further_lr_note

        plan = load_plan_yaml(result.last_checkpoint / PLAN_FILE)
        console.print(f"[bold green]finished[/]: {result.output_dir} ended at step {result.steps} "
                      f"({result.last_checkpoint}); nothing to resume. To train further: "
                      f"{further_command(plan, result.output_dir, result.steps)}", highlight=False, soft_wrap=True)
        note_line(further_lr_note(plan.train, result.steps))
        return
    from zfctl.cli.finetune import print_done

    # as finetune ends: the losses and the next commands, from the plan that ran (its newest checkpoint's)
    if result.last_checkpoint is None:
        console.print(f"[bold green]done[/] {result.steps} steps  ->  {result.output_dir}", highlight=False,
                      soft_wrap=True)
        return
    print_done(load_plan_yaml(result.last_checkpoint / PLAN_FILE), result)
