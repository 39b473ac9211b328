"""`zfctl plan MODEL --data DATA ...`: resolve, print the plan and a memory estimate, exit."""

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
    dumps_json,
    plan_flags,
    resolve_from_cli,
)


def plan(
    model: str = MODEL_ARG,
    data: str = DATA_OPT,
    zenflow: str | None = ZENFLOW_OPT,
    config: Path | None = CONFIG_OPT,
    set_: list[str] | None = SET_OPT,
    output: Path | None = OUTPUT_OPT,
    max_steps: int | None = MAX_STEPS_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print {plan, memory, notes} as JSON instead."),
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
