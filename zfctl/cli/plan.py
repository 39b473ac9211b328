"""`zfctl plan MODEL --data DATA ...`: resolve, print the plan and a memory estimate, exit."""

from __future__ import annotations

from typing import Annotated

import typer

from zfctl.cli._common import (
    ConfigOpt,
    DataOpt,
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
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {plan, memory, notes} as JSON instead.")
    ] = False,
) -> None:
    """Resolve the run plan, print it with a memory estimate for this machine, and exit.

    Takes the same options as `finetune`; nothing is loaded or written.
    """
    from zfctl.plan import plan_to_dict
    from zfctl.plan.memory import estimate
    from zfctl.plan.render import print_memory, print_plan

    resolved, notes = resolve_from_cli(
        model, data, zenflow, config, set_ or [], plan_flags(output, max_steps), quiet=as_json
    )
    est = estimate(resolved)
    if as_json:
        print(dumps_json({"plan": plan_to_dict(resolved), "memory": est.to_dict(), "notes": notes}))
        return
    print_plan(resolved, console)
    print_memory(est, console)
