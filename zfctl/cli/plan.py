"""`zfctl plan MODEL --data DATA ...`: resolve, print the plan and a memory estimate, exit."""

from __future__ import annotations

from typing import Annotated

import typer

from zfctl.cli._common import (
    ConfigOpt,
    DataOpt,
    GpuMemoryOpt,
    HostMemoryOpt,
    MaxStepsOpt,
    ModelArg,
    OutputOpt,
    SetOpt,
    ZenflowOpt,
    console,
    dumps_json,
    plan_flags,
    resolve_from_cli,
)


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
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {plan, memory, notes} as JSON instead.")
    ] = False,
) -> None:
    """Resolve the run plan, print it with a memory estimate, and exit.

    Takes the same options as `finetune`; nothing is loaded or written. The estimate is checked
    against this machine, or against the sizes --gpu-memory / --host-memory give (plan a GPU run
    from a laptop).
    """
    from zfctl.plan import plan_to_dict
    from zfctl.plan.memory import estimate
    from zfctl.plan.render import print_memory, print_plan
    from zfctl.train.preflight import check_for_plan

    flags = plan_flags(output, max_steps, gpu_memory=gpu_memory, host_memory=host_memory)
    resolved, notes = resolve_from_cli(model, data, zenflow, config, set_ or [], flags, quiet=as_json)
    check_for_plan(resolved)  # what finetune would refuse before its plan: refused before this one too
    est = estimate(resolved)
    if as_json:
        print(dumps_json({"plan": plan_to_dict(resolved), "memory": est.to_dict(), "notes": notes}))
        return
    print_plan(resolved, console)
    print_memory(est, console)
