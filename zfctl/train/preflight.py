"""Checks that need no model and no tokenised data, run before the plan is printed.

A user who mistyped ``--output`` or points ``--data`` at a file with the wrong fields should get
one ``error:`` line within a second, not after the 70-line plan and a model load. What is
checked here is cheap: the output folder's state, and the first record of a local data file
rendered through the plan's template (the same code the data pipeline runs on every record),
and the free disk space against the plan's checkpoint size (from its parameter count).
Everything else (all records, the tokenizer, the model) is still checked where it is loaded.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from zfctl.errors import UserError
from zfctl.plan.memory import model_size
from zfctl.plan.schema import RunPlan
from zfctl.train.checkpoint import OPTIMIZER_BYTES_PER_PARAM, check_run_space
from zfctl.train.data.chat import normalize
from zfctl.train.data.source import resolve
from zfctl.train.data.templates import render
from zfctl.train.lock import check_free
from zfctl.train.rundir import check_output_dir

_JSON_SNIFF_LIMIT = 64 << 20  # a .json list must be parsed whole: only peek into small ones


def _first_record(path: Path) -> object | None:
    """The first record of a .jsonl/.csv file (or a small .json list); None when not cheap."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                line = next((ln for ln in f if ln.strip()), None)
            return None if line is None else json.loads(line)
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8") as f:
                return next(csv.DictReader(f), None)
        if suffix == ".json" and path.stat().st_size < _JSON_SNIFF_LIMIT:
            data = json.loads(path.read_text(encoding="utf-8"))
            return data[0] if isinstance(data, list) and data else None
    except (OSError, ValueError):  # unreadable or malformed: the pipeline names the line
        return None
    return None


def preflight(plan: RunPlan, *, force: bool, output: bool = True) -> None:
    """Raise a UserError for a bad output folder or a local data file of the wrong shape."""
    if output:
        out = Path(plan.checkpoint.output_dir)
        check_output_dir(out, force)
        # A live run in the folder is refused here, before anything else looks inside it.
        check_free(out)
        size = model_size(plan)  # from the config: no model is built (None for hub models)
        if size is not None:
            weight_bytes = 4 if plan.train.precision == "fp32" else 2
            # No cleaning here: this process holds no lock yet (the session cleans under it).
            check_run_space(out, size.params * (weight_bytes + OPTIMIZER_BYTES_PER_PARAM), reclaim=force,
                            clean=False)
    if plan.data.source == "hub":
        return
    source = resolve(plan.data)
    rec = _first_record(Path(source.train))
    if rec is not None and plan.data.template == "chat":
        normalize(rec, source.train, 0)  # roles, turns, an assistant turn: no tokenizer needed
    elif rec is not None:
        render(rec, plan.data, source.train, 0)  # RecordError names the file, record and field
    elif Path(source.train).suffix.lower() in (".jsonl", ".csv") and Path(source.train).stat().st_size == 0:
        raise UserError(f"{source.train}: holds no records")
