"""Checks that need no model and no tokenised data, run before the plan is printed.

A user who mistyped ``--output`` or points ``--data`` at a file with the wrong fields should get
one ``error:`` line within a second, not after the 70-line plan and a model load. What is
checked here is cheap: the output folder (its state, a live run in it, that it can be written,
and the free disk space against the plan's checkpoint size from its parameter count), and the first record of a local data file rendered through the plan's template (the same
code the data pipeline runs on every record). Everything else (all records, the tokenizer, the
model) is still checked where it is loaded. ``zfctl plan`` runs the same data check and the part
of the output check that no flag can fix (:func:`check_for_plan`), so that it accepts only what
``finetune`` would.
"""

from __future__ import annotations

import os
from pathlib import Path

from zfctl.errors import UserError
from zfctl.plan.memory import model_size
from zfctl.plan.schema import RunPlan
from zfctl.train.data.chat import normalize
from zfctl.train.data.source import first_record, resolve
from zfctl.train.data.templates import render
from zfctl.writable import nearest_existing


def preflight(plan: RunPlan, *, force: bool, output: bool = True) -> None:
    """Raise a UserError for a bad output folder or a local data file of the wrong shape."""
    if output:
        # Here, not at the top: the run folder's checks load the checkpoint code and with it torch
        # (~2 s), which `zfctl plan` (check_for_plan) must not pay (tests/cli/test_light_verbs.py).
        from zfctl.train.checkpoint import OPTIMIZER_BYTES_PER_PARAM
        from zfctl.train.rundir import RunFolder

        folder = RunFolder(Path(plan.checkpoint.output_dir), force=force)
        folder.check()
        size = model_size(plan)  # from the config: no model is built (None for hub models)
        if size is not None:
            weight_bytes = 4 if plan.train.precision == "fp32" else 2
            folder.check_space(size.params * (weight_bytes + OPTIMIZER_BYTES_PER_PARAM))
    check_data(plan)


def check_for_plan(plan: RunPlan) -> None:
    """What ``zfctl plan`` refuses: a data file ``finetune`` would refuse, an output path that is
    (or lies under) a file. Nothing is written, not even a probe: an existing run folder is left
    to ``finetune``, where ``--force`` decides."""
    out = Path(plan.checkpoint.output_dir)
    place = nearest_existing(out)
    if not place.is_dir():
        where = "exists and is not a folder" if place == Path(os.path.abspath(out)) else f"is under {place}, a file"
        raise UserError(f"output {out} {where}; choose another --output")
    check_data(plan)


def check_data(plan: RunPlan) -> None:
    """A local data file's first record, read and rendered as the pipeline will (hub data: nothing)."""
    if plan.data.source == "hub":
        return
    source = resolve(plan.data)
    rec = first_record(Path(source.train))  # a file that cannot be read, or holds nothing: refused here
    if rec is not None and plan.data.template == "chat":
        normalize(rec, source.train, 0)  # roles, turns, an assistant turn: no tokenizer needed
    elif rec is not None:
        render(rec, plan.data, source.train, 0)  # RecordError names the file, record and field
