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

from zfctl.errors import ConfigError, UserError
from zfctl.plan.memory import model_size
from zfctl.plan.schema import RunPlan
from zfctl.train.data.chat import normalize
from zfctl.train.data.source import count_records, first_record, resolve
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
    check_data(plan, batch=output)


def check_for_plan(plan: RunPlan) -> None:
    """What ``zfctl plan`` refuses: a data file ``finetune`` would refuse, an output path that is
    (or lies under) a file. Nothing is written, not even a probe: an existing run folder is left
    to ``finetune``, where ``--force`` decides."""
    out = Path(plan.checkpoint.output_dir)
    place = nearest_existing(out)
    if not place.is_dir():
        where = "exists and is not a folder" if place == Path(os.path.abspath(out)) else f"is under {place}, a file"
        raise UserError(f"output {out} {where}; choose another --output")
    check_data(plan, model_keys=False)


def check_data(plan: RunPlan, *, batch: bool = True, model_keys: bool = True) -> None:
    """``model.config``'s keys (``model_keys``: the architecture built from them), then a local
    data file's first record, read and rendered as the pipeline will (hub data: nothing), then
    (``batch``; not for ``--debug-data``, which trains nothing) that the data fills one global
    micro-batch, and that each of ``train.sample_prompts`` leaves the model room to answer
    (zfctl/train/samples.py). ``zfctl plan`` leaves the keys out: checking them imports
    transformers (and with it torch, seconds on a loaded machine), which that light verb never
    does; finetune, which loads both anyway, refuses a mistyped key here, before its plan is
    printed. Sample prompts need the tokenizer, so a plan that has them pays that import."""
    if model_keys and plan.model.source == "config" and plan.model.config:
        from zfctl.train.models.config_keys import check_config_keys

        check_config_keys(dict(plan.model.config))
    if plan.data.source != "hub":
        source = resolve(plan.data)
        rec = first_record(Path(source.train))  # a file that cannot be read, or holds nothing: refused here
        if rec is not None and plan.data.template == "chat":
            normalize(rec, source.train, 0)  # roles, turns, an assistant turn: no tokenizer needed
        elif rec is not None:
            render(rec, plan.data, source.train, 0)  # RecordError names the file, record and field
        if batch:
            check_batch(plan, Path(source.train), held_out=source.eval is None)
    if plan.train.sample_prompts:  # the tokenizer (transformers, seconds): only for a plan that has them
        from zfctl.train.samples import check_sample_prompts

        check_sample_prompts(plan)


def check_batch(plan: RunPlan, train_file: Path, *, held_out: bool) -> None:
    """Refuse a global micro-batch (``train.micro_batch_size`` x processes) larger than the
    training records, before the plan sizes memory for it: no step could be filled, and on one
    process the run would quietly train on fewer sequences per step than the plan printed. The
    records are counted cheaply (``count_records``: None for a file too large to count now; the
    run's sampler checks it then)."""
    n = count_records(train_file)
    if n is None:
        return
    d, t = plan.data, plan.train
    records = max(0, (n if d.end_idx is None else min(d.end_idx, n)) - d.start_idx)
    if held_out and d.validation_fraction > 0 and records > 1:
        records -= max(1, round(d.validation_fraction * records))  # the pipeline's hold-out (prepare.py)
    world = plan.distributed.nproc * plan.distributed.nodes
    if records < 1 or t.micro_batch_size * world <= records:
        return
    fits = records // world
    per = f" per process x {world} processes" if world > 1 else ""
    fix = (f"use at most {fits:,} (a micro-batch is what fits the device memory at once; a larger batch is "
           "train.gradient_accumulation_steps)" if fits >= 1 else f"use at most {records:,} processes, or more data")
    raise ConfigError("train.micro_batch_size", t.micro_batch_size,
                      f"one micro-batch{per} is more than the {records:,} training records of {d.name or train_file}; "
                      f"{fix}")
