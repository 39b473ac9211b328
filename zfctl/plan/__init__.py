"""zfctl.plan: presets, config files and overrides resolved into one validated RunPlan.

    resolve_plan(model, data, zenflow=..., config=..., overrides=[...]) -> RunPlan
    plan_to_dict / plan_from_dict / dump_plan_yaml / load_plan_yaml

`memory.estimate` and `render.print_plan` are imported from their modules when needed (they pull
in torch/rich; resolving a plan should not, except that `train.precision: auto` with a device
other than cpu asks torch whether there is a GPU and whether it has bf16: `precision`).
"""

from zfctl.plan.io import dump_plan_yaml, load_plan_yaml, plan_from_dict, plan_to_dict
from zfctl.plan.resolve import resolve_plan
from zfctl.plan.schema import RunPlan

__all__ = ["RunPlan", "dump_plan_yaml", "load_plan_yaml", "plan_from_dict", "plan_to_dict", "resolve_plan"]
