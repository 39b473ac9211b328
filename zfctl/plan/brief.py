"""The run plan in a few lines, for the start of `zfctl finetune` and `zfctl resume`.

The whole plan is about 80 lines (every key of every section, `render.plan_table`): right for
`zfctl plan` and for `--verbose`, but at the start of a run it pushed the first step line off a
new user's screen. The brief shows, per section, the keys a reader needs to know what will run
(model, data, schedule, batch, precision, the ZenFlow options, the output folder) and every other
key whose value differs from the schema's default, so nothing a preset, `--config` or `--set`
changed is hidden. Left out: a model's architecture (``model.config``, ``model.arch``,
``model.params_b``; the memory line under the plan sums it up) and the presets' one-line
descriptions. The run folder's plan.yaml holds every key, with its help text.
"""

from __future__ import annotations

from typing import Any

from zfctl.plan.io import plan_to_dict
from zfctl.plan.schema import SECTIONS, RunPlan

# Shown whatever their value; dotted below the section (zenflow.tuning.* keys as tuning.KEY).
HEADLINE: dict[str, tuple[str, ...]] = {
    "model": ("name", "source"),
    "data": ("name", "template", "max_length"),
    "train": ("lr", "schedule", "epochs", "max_steps", "micro_batch_size", "gradient_accumulation_steps",
              "precision"),
    "zenflow": ("topk_ratio", "update_interval", "select_interval", "full_warm_up_rounds", "overlap_step",
                "accumulate"),
    "checkpoint": ("output_dir",),
}
# Never shown here (see the module docstring).
LEFT_OUT = {"model.config", "model.arch", "model.params_b", "model.description", "data.description"}
VALUE_LIMIT = 48  # characters of a list or mapping value; plan.yaml holds the whole (a path is never cut)


def _flat(values: dict, prefix: str = "") -> dict[str, Any]:
    """{'tuning.ring_slots': 4, ...}: nested sections (zenflow.tuning) as dotted keys."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and key == "tuning":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        text = "[" + ", ".join(str(v) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    else:
        return str(value)
    return text if len(text) <= VALUE_LIMIT else text[: VALUE_LIMIT - 3] + "..."


def brief_lines(plan: RunPlan) -> list[str]:
    """One line per section that has something to show: ``section: key=value key=value ...``."""
    data, defaults = plan_to_dict(plan), plan_to_dict(RunPlan())
    lines = []
    for section in SECTIONS:
        values, base = _flat(data[section]), _flat(defaults[section])
        keys = [k for k in HEADLINE.get(section, ()) if k in values]
        keys += [k for k in values if k not in keys and values[k] != base.get(k)]
        keys = [k for k in keys if f"{section}.{k}" not in LEFT_OUT]
        if keys:
            lines.append(f"{section}: " + " ".join(f"{k}={_short(values[k])}" for k in keys))
    return lines
