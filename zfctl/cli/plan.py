"""`zfctl plan MODEL --data DATA ...`: resolve, print the plan and a memory estimate, exit."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from zfctl.cli._common import (
    ConfigOpt,
    DataOpt,
    FitOpt,
    GpuMemoryOpt,
    GpusPerNodeOpt,
    HostMemoryOpt,
    MaxStepsOpt,
    ModelArg,
    NodesOpt,
    OutputOpt,
    SetOpt,
    ZenflowOpt,
    console,
    dumps_json,
    note_line,
    plan_flags,
    print_run_plan,
    resolve_from_cli,
)

# `zfctl plan`'s exit code when the plan does not fit the machine: not 1 (a failure of zfctl) nor
# 2 (bad input), so a script can tell "this machine is too small" from both.
DOES_NOT_FIT = 3


def plan(
    model: ModelArg,
    data: DataOpt,
    zenflow: ZenflowOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    output: OutputOpt = None,
    max_steps: MaxStepsOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    host_memory: HostMemoryOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    fit: FitOpt = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {plan, memory, fit, notes} as JSON instead.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", help="Print every key of the plan, not only the keys that matter and "
                           "those changed from their defaults.")
    ] = False,
) -> None:
    """Resolve the run plan, print whether it fits the machine, then the plan and its memory estimate.

    Takes the same options as `finetune`; nothing is loaded or written. The first line is the
    verdict (it fits / it does not fit, and why), then the device and host totals and the machine
    they are checked against: this one, or the sizes --gpu-memory / --host-memory give (plan a GPU
    run from a laptop). When the plan does not fit, the cheapest changes that make it fit follow
    (--fit applies them) and the exit code is 3. Below: the plan (every key with --verbose) and the
    memory table, a line per buffer.
    """
    from zfctl.plan import plan_to_dict
    from zfctl.plan.fit import fit as find_fit
    from zfctl.plan.fit import fit_or_fail
    from zfctl.plan.render import print_memory, print_verdict
    from zfctl.plan.settle import settle
    from zfctl.train.preflight import check_for_plan

    flags = plan_flags(output, max_steps, gpu_memory=gpu_memory, host_memory=host_memory, nodes=nodes,
                       gpus_per_node=gpus_per_node)
    # Notes wait until --fit has its answer: when nothing fits, the error is the only line.
    resolved, notes = resolve_from_cli(model, data, zenflow, config, set_ or [], flags, quiet=True)
    check_for_plan(resolved)  # what finetune would refuse before its plan: refused before this one too
    result = fit_or_fail(resolved) if fit else find_fit(resolved)
    # Every auto decided once, here, for the plan as it will run (after --fit): what the printed
    # plan and the JSON show is what finetune saves as plan.yaml and the run builds (settle.py).
    shown = settle(result.plan if fit else resolved, notes=notes)
    est = result.estimate if fit else result.before
    if est.no_model_fits and not as_json:  # the one line that matters: no plan or note would change it
        console.print(Text(est.no_model_fits, style="bold red"), soft_wrap=True)
        raise typer.Exit(code=DOES_NOT_FIT)
    if as_json:
        print(dumps_json({"plan": plan_to_dict(shown), "memory": est.to_dict(),
                          "fit": {**result.to_dict(), "applied": fit}, "notes": notes}))
    else:
        # The answer first (a whole plan is ~90 lines): the verdict and totals, what to change,
        # the notes; then the plan (brief unless --verbose) and the table the totals add up.
        print_verdict(est, result, console, applied=fit)
        for note in notes:
            note_line(note)
        print_run_plan(shown, verbose=verbose, holds_all="--json holds all")
        print_memory(est, console)
    if est.size is not None and not est.fits:
        raise typer.Exit(code=DOES_NOT_FIT)
