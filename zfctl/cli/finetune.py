"""`zfctl finetune MODEL --data DATA ...`: resolve the plan, print it, train."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from zfctl.cli._common import (
    ConfigOpt,
    DataOpt,
    ForceOpt,
    GpuMemoryOpt,
    HostMemoryOpt,
    MaxStepsOpt,
    ModelArg,
    OutputOpt,
    SetOpt,
    ZenflowOpt,
    console,
    plan_flags,
    resolve_from_cli,
    warning_line,
)
from zfctl.errors import UserError


def finetune(
    model: ModelArg,
    data: DataOpt,
    zenflow: ZenflowOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    output: OutputOpt = None,
    max_steps: MaxStepsOpt = None,
    force: ForceOpt = False,
    gpu_memory: GpuMemoryOpt = None,
    host_memory: HostMemoryOpt = None,
    debug_data: Annotated[
        bool,
        typer.Option(
            "--debug-data", help="Print a few decoded training samples with their label masks and exit."
        ),
    ] = False,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            min=1,
            help="Processes on this node: >1 relaunches under torchrun (standalone rendezvous). "
            "Under your own torchrun (multi-node, slurm) leave it out.",
        ),
    ] = None,
) -> None:
    """Fine-tune MODEL on DATA with ZenFlow CPU-offloaded AdamW.

    Resolution order: model preset < data preset < zenflow preset < --config < --set < flags.
    The resolved plan is printed first and saved as plan.yaml in the output folder.
    """
    from zfctl.plan.advice import accuracy_warnings
    from zfctl.plan.render import print_plan
    from zfctl.train.dist import (
        PLAN_PRINTED_ENV,
        bind_to_launcher,
        dist_env,
        rank_error,
        relaunch,
        under_torchrun,
        worker_argv,
    )

    bind_to_launcher()  # a rank of an --nproc job dies with it, even when the launcher is SIGKILLed
    env = dist_env()
    flags = plan_flags(output, max_steps, nproc, gpu_memory=gpu_memory, host_memory=host_memory)
    plan, _ = resolve_from_cli(model, data, zenflow, config, set_ or [], flags, quiet=not env.is_main)
    if env.is_main and not os.environ.get(PLAN_PRINTED_ENV) and not debug_data:
        # Once per run: a torchrun relaunch sets PLAN_PRINTED_ENV, so its workers stay quiet.
        for line in accuracy_warnings(plan):
            warning_line(line)
    try:
        from zfctl.train import run
    except ImportError:
        what = (
            "training"
            if plan.distributed.nproc == 1
            else f"--nproc {plan.distributed.nproc}: multi-process training"
        )
        raise UserError(
            f"{what} is not available yet in this build (zfctl.train.run is missing); "
            "`zfctl plan` shows the resolved plan and memory estimate"
        ) from None
    if env.is_main and not os.environ.get(PLAN_PRINTED_ENV):
        from zfctl.train.preflight import preflight

        preflight(plan, force=force, output=not debug_data)  # before the plan: one line, in a second
    if plan.distributed.nproc > 1 and not under_torchrun() and not debug_data:
        # Everything that can fail on user input is checked here, once, before N processes start;
        # the data lands in the cache, so the ranks load it instead of tokenising it N times.
        from zfctl.train.dist import prepare_launch

        print_plan(plan, console)
        _memory_line(plan)
        prepare_launch(plan, force=force)
        console.print(f"launching {plan.distributed.nproc} processes under torchrun (standalone)")
        raise typer.Exit(
            code=relaunch(plan.distributed.nproc, worker_argv(sys.argv[1:], "distributed.nproc"))
        )
    if env.is_main and not os.environ.get(PLAN_PRINTED_ENV):
        print_plan(plan, console)
        _memory_line(plan)
    try:
        result = run(plan, force=force, debug_data=debug_data)
    except Exception as e:  # a user error or a lost peer: one line per rank; a bug: as is
        named = rank_error(e, env, plan.distributed.timeout)
        if named is e:
            raise
        raise named from None
    if debug_data or not env.is_main:
        return
    console.print(
        f"[bold green]done[/] {result.steps} steps  train loss (last step) {_fmt(result.final_train_loss)}  "
        f"eval loss {_fmt(result.final_eval_loss)}  ->  {result.output_dir}"
    )
    if result.last_checkpoint:
        console.print(f"checkpoint: {result.last_checkpoint}  (continue: zfctl resume {result.output_dir})")


def _memory_line(plan) -> None:
    """The memory verdict under the plan (`zfctl plan` shows every line): a note when it fits, a
    warning naming the largest lines when it does not (the estimate is rough; the run goes on)."""
    from zfctl.plan.memory import estimate
    from zfctl.plan.render import verdict_line

    est = estimate(plan)
    if est.fits or est.size is None:
        console.print(verdict_line(est), style="dim")
    else:
        warning_line(verdict_line(est) + "; see `zfctl plan` for every line")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
