"""Checks that need no model and no tokenised data, run before the plan is printed.

A user who mistyped ``--output`` or points ``--data`` at a file with the wrong fields should get
one ``error:`` line within a second, not after the 70-line plan and a model load. What is
checked here is cheap: the output folder (its state, a live run in it, that it can be written,
and the free disk space against the plan's checkpoint size from its parameter count), and the first record of a local data file rendered through the plan's template (the same
code the data pipeline runs on every record). Everything else (all records, the tokenizer, the
model) is still checked where it is loaded.
"""

from __future__ import annotations

from pathlib import Path

from zfctl.errors import UserError
from zfctl.plan.memory import model_size
from zfctl.plan.resolve import first_record
from zfctl.plan.schema import RunPlan
from zfctl.train.checkpoint import OPTIMIZER_BYTES_PER_PARAM
from zfctl.train.data.chat import normalize
from zfctl.train.data.source import resolve
from zfctl.train.data.templates import render
from zfctl.train.rundir import RunFolder


def preflight(plan: RunPlan, *, force: bool, output: bool = True) -> None:
    """Raise a UserError for a bad output folder or a local data file of the wrong shape."""
    if output:
        folder = RunFolder(Path(plan.checkpoint.output_dir), force=force)
        folder.check()
        size = model_size(plan)  # from the config: no model is built (None for hub models)
        if size is not None:
            weight_bytes = 4 if plan.train.precision == "fp32" else 2
            folder.check_space(size.params * (weight_bytes + OPTIMIZER_BYTES_PER_PARAM))
    if plan.data.source == "hub":
        return
    source = resolve(plan.data)
    rec = first_record(Path(source.train))
    if rec is not None and plan.data.template == "chat":
        normalize(rec, source.train, 0)  # roles, turns, an assistant turn: no tokenizer needed
    elif rec is not None:
        render(rec, plan.data, source.train, 0)  # RecordError names the file, record and field
    elif Path(source.train).suffix.lower() in (".jsonl", ".csv") and Path(source.train).stat().st_size == 0:
        raise UserError(f"{source.train}: holds no records")
