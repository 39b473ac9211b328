"""`zfctl finetune MODEL --data DATA ...`: resolve the plan, print it, train."""

from __future__ import annotations

from pathlib import Path

import typer

from zfctl.cli._common import (
    CONFIG_OPT,
    DATA_OPT,
    MAX_STEPS_OPT,
    MODEL_ARG,
    OUTPUT_OPT,
    SET_OPT,
    ZENFLOW_OPT,
    console,
    plan_flags,
    resolve_from_cli,
)
from zfctl.errors import UserError


def finetune(
    model: str = MODEL_ARG,
    data: str = DATA_OPT,
    zenflow: str | None = ZENFLOW_OPT,
    config: Path | None = CONFIG_OPT,
    set_: list[str] | None = SET_OPT,
    output: Path | None = OUTPUT_OPT,
    max_steps: int | None = MAX_STEPS_OPT,
    force: bool = typer.Option(False, "--force", help="Replace an existing, non-empty output folder."),
    debug_data: bool = typer.Option(
        False, "--debug-data", help="Print a few decoded training samples with their label masks and exit."
    ),
    nproc: int = typer.Option(
        1, "--nproc", min=1, help="Processes on this node (relaunches under torchrun)."
    ),
) -> None:
    """Fine-tune MODEL on DATA with ZenFlow CPU-offloaded AdamW.

    Resolution order: model preset < data preset < zenflow preset < --config < --set < flags.
    The resolved plan is printed first and saved as plan.yaml in the output folder.
    """
    from zfctl.plan.render import print_plan

    plan, _ = resolve_from_cli(model, data, zenflow, config, set_ or [], plan_flags(output, max_steps, nproc))
    print_plan(plan, console)
    if plan.distributed.nproc > 1:
        raise UserError(
            f"--nproc {plan.distributed.nproc}: multi-process training is not available yet; "
            "run with --nproc 1"
        )
    try:
        from zfctl.train import run
    except ImportError:
        raise UserError(
            "training is not available yet in this build (zfctl.train.run is missing); "
            "`zfctl plan` shows the resolved plan and memory estimate"
        ) from None
    result = run(plan, force=force, debug_data=debug_data)
    if debug_data:
        return
    console.print(
        f"[bold green]done[/] {result.steps} steps  train loss {_fmt(result.final_train_loss)}  "
        f"eval loss {_fmt(result.final_eval_loss)}  ->  {result.output_dir}"
    )
    if result.last_checkpoint:
        console.print(f"checkpoint: {result.last_checkpoint}  (continue: zfctl resume {result.output_dir})")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
