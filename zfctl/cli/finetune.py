"""`zfctl finetune MODEL --data DATA ...`: resolve the plan, print it, train."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer

from zfctl.cli._common import (
    ConfigOpt,
    DataOpt,
    FitOpt,
    ForceOpt,
    GpuMemoryOpt,
    HostMemoryOpt,
    MaxStepsOpt,
    ModelArg,
    OutputOpt,
    SetOpt,
    VerboseOpt,
    ZenflowOpt,
    console,
    note_line,
    plan_flags,
    print_run_plan,
    resolve_from_cli,
    warning_line,
)


def finetune(
    model: ModelArg,
    data: DataOpt,
    zenflow: ZenflowOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    output: OutputOpt = None,
    max_steps: MaxStepsOpt = None,
    force: ForceOpt = False,
    gpu_memory: GpuMemoryOpt = None,
    host_memory: HostMemoryOpt = None,
    fit: FitOpt = False,
    debug_data: Annotated[
        bool,
        typer.Option(
            "--debug-data", help="Print a few decoded training samples with their label masks and exit."
        ),
    ] = False,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            min=1,
            help="Processes on this node: >1 relaunches under torchrun (standalone rendezvous). "
            "Under your own torchrun (multi-node, slurm) leave it out.",
        ),
    ] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Fine-tune MODEL on DATA with ZenFlow CPU-offloaded AdamW.

    Resolution order: model preset < data preset < zenflow preset < --config < --set < flags.
    The resolved plan is printed first (its main keys and those changed from their defaults;
    all of it with --verbose) and saved as plan.yaml in the output folder.

    One line per logging.every steps: loss = train loss, the mean since the last line (avg N);
    lr = learning rate; tok/s = tokens per second; ms = the whole step: fwd/bwd (device forward +
    backward) + opt (device optimizer) + stall (host waits inside the step: gradient copies, the
    CPU update, installs), busy = the device's share; cpu-adam = ms of the CPU AdamW update that
    finished this step; sel = share of weights updated on the device every step (0.00 during
    zenflow.full_warm_up_rounds: synchronous full CPU-offload steps); stay = share of the device's
    columns kept at the last selection (shown once after each, from the second on); gnorm = gradient
    L2 norm before clipping;
    host/dev = peak memory, GiB.

    Ctrl-C or SIGTERM finishes the step (or the checkpoint being written), saves a checkpoint and
    exits 130 / 143 with the resume command; a second one aborts at once and removes the
    half-written checkpoint.
    """
    from zfctl.quiet import set_verbose

    set_verbose(verbose)  # before transformers loads: its bars read the environment once
    from zfctl.train.dist import PLAN_PRINTED_ENV, bind_to_launcher, dist_env

    bind_to_launcher()  # a rank of an --nproc job dies with it, even when the launcher is SIGKILLed
    from zfctl.plan.advice import accuracy_warnings
    from zfctl.train.launch import Launched
    from zfctl.train.launch import finetune as start

    env = dist_env()
    flags = plan_flags(output, max_steps, nproc, gpu_memory=gpu_memory, host_memory=host_memory)
    plan, notes = resolve_from_cli(model, data, zenflow, config, set_ or [], flags, quiet=True)
    if fit or (env.is_main and not os.environ.get(PLAN_PRINTED_ENV)):
        from zfctl.train.preflight import check_data

        # The data and model.config before any note on the plan: a micro-batch larger than the
        # data is refused here, never fitted, and the notes never size memory for it first.
        check_data(plan, batch=not debug_data)
    if fit:  # every rank of an --nproc job fits the same plan the same way; nothing fits: one error line
        from zfctl.plan.fit import fit_or_fail

        fitted = fit_or_fail(plan)
        plan = fitted.plan
        if fitted.changes:
            notes.append("--fit changed: " + " ".join(c.flags for c in fitted.changes))
    from zfctl.plan.settle import settle

    # Every auto decided once, for the plan as it will run (after --fit), against the machine it
    # names: printed, saved as plan.yaml, built by the run, which only checks it (zfctl/plan/settle.py).
    plan = settle(plan, notes=notes)
    if env.is_main:
        for note in notes:
            note_line(note)
    if env.is_main and not os.environ.get(PLAN_PRINTED_ENV) and not debug_data:
        # Once per run: a torchrun relaunch sets PLAN_PRINTED_ENV, so its workers stay quiet.
        for line in accuracy_warnings(plan):
            warning_line(line)
    result = start(plan, force=force, debug_data=debug_data, argv=sys.argv[1:], show_plan=_show_plan)
    if isinstance(result, Launched):
        raise typer.Exit(code=result.code)
    if debug_data or not env.is_main:
        return
    print_done(plan, result)


def print_done(plan, result) -> None:
    """How a run that trained ends, for `finetune` and `resume` alike: the steps, the last
    losses, the newest checkpoint, and the `next:` commands (with a note on what training further
    does to the learning rate)."""
    console.print(
        f"[bold green]done[/] {result.steps} steps  train loss (last step) {_fmt(result.final_train_loss)}  "
        f"eval loss {_fmt(result.final_eval_loss)}  ->  {result.output_dir}", highlight=False, soft_wrap=True
    )
    if result.last_checkpoint:
        console.print(f"checkpoint: {result.last_checkpoint}", highlight=False, soft_wrap=True)
        console.print("next:", style="bold")
        for line in next_commands(plan, result.output_dir, result.steps):
            console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
        note_line(further_lr_note(plan.train, result.steps))


# A first prompt to try, per template: a question of the shipped samples' kind, or a start of text.
_TRY = {"classification": "A warm, funny film with a clever script.", "text": "The"}


def further_steps(train, steps: int) -> int:
    """The --max-steps the `next:` block suggests to train further: twice as long where the LR of
    the steps to come does not depend on the run's length (constant schedule, inside the LR
    warm-up); else a quarter more, so that the stretched cosine or linear schedule takes the LR
    from its end (~0) back to only about a tenth (cosine; a fifth: linear) of train.lr, not
    the half of train.lr that doubling a cosine run gives (which undid a short run's progress)."""
    from zfctl.train.run_length import first_lr_change

    if first_lr_change(train, steps, 2 * steps, steps) is None:
        return 2 * steps
    return steps + max(1, steps // 4)


def further_lr_note(train, steps: int) -> str:
    """What the `next:` block's resume does to the LR, in one line."""
    from zfctl.train.run_length import first_lr_change
    from zfctl.train.schedule import lr_multiplier

    end = further_steps(train, steps)
    if first_lr_change(train, steps, end, steps) is None:
        return (f"`zfctl resume --max-steps {end}` continues the same LR schedule ({train.schedule}, train.lr "
                f"{train.lr:g}): the steps to come train as if the run had been planned {end} steps long")
    lr = train.lr * lr_multiplier(train.schedule, train.warmup_steps, end)(steps)
    return (f"`zfctl resume --max-steps {end} --allow-changes` stretches the {train.schedule} LR schedule to end at "
            f"step {end}: the LR, ~0 at the end of this run, restarts at {lr:.3g} at step {steps + 1} "
            f"({lr / train.lr:.0%} of train.lr {train.lr:g}) and decays to 0 again; a larger --max-steps restarts "
            "it higher (2x this run's steps: at half of train.lr)")


def next_commands(plan, run: Path, steps: int) -> list[str]:
    """What to do with a finished run, as commands that run as printed in this shell: activate
    the environment first when `zfctl` on PATH is not this one (``make demo`` runs
    .venv/bin/zfctl), then try the model (a chat run: an interactive chat), export it (into a new
    folder, :func:`export_folder`), and train it further (:func:`further_steps`). Each runs as
    printed, also after an earlier block was followed (tests/e2e/test_next_blocks.py)."""
    run_arg = shlex.quote(str(run))
    if plan.data.template == "chat":
        try_it = f"zfctl generate {run_arg} --chat"
    else:
        try_it = f"zfctl generate {run_arg} --prompt {shlex.quote(_TRY.get(plan.data.template, 'What is 12 + 7?'))}"
    lines = [try_it, f"zfctl export {run_arg} --output {shlex.quote(str(export_folder(run, steps)))}",
             further_command(plan, run, steps)]
    activate = activate_command()
    return ([activate] if activate else []) + lines


def export_folder(run: Path, steps: int) -> Path:
    """Where the `next:` block's export writes: a new folder named after the run and its step
    (``runs/demo-hf-step118``), so the export that a resume's block prints never meets the one an
    earlier block made (export refuses an existing folder without --force, and --force would
    replace the earlier step's weights). A name already taken (a run replaced by `finetune --force`
    and exported at the same step) gets the first free ``-2``, ``-3``, ... after it."""
    base = f"{run}-hf-step{steps}"
    taken = 1
    folder = Path(base)
    while folder.exists() and not (folder.is_dir() and not any(folder.iterdir())):  # an empty folder is free
        taken += 1
        folder = Path(f"{base}-{taken}")
    return folder


def further_command(plan, run: Path, steps: int) -> str:
    """The resume that trains a run of ``steps`` further (:func:`further_steps`). It moves the end
    of the LR schedule: refused without --allow-changes when that changes the LR of a step still
    to run (zfctl/train/run_length.py), so the flag is added exactly then."""
    from zfctl.train.run_length import first_lr_change

    end = further_steps(plan.train, steps)
    allow = "" if first_lr_change(plan.train, steps, end, steps) is None else " --allow-changes"
    return f"zfctl resume {shlex.quote(str(run))} --max-steps {end}{allow}"


def activate_command() -> str | None:
    """``source VENV/bin/activate`` when this zfctl runs from a virtual environment whose bin
    folder is not where `zfctl` resolves on PATH; None when the bare `zfctl` already is this one."""
    bin_dir = Path(sys.prefix) / "bin"
    if sys.prefix == sys.base_prefix or not (bin_dir / "activate").is_file():
        return None
    found = shutil.which("zfctl")
    if found is not None and Path(found).parent.resolve() == bin_dir.resolve():
        return None
    activate = bin_dir / "activate"
    try:
        shown = str(activate.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:  # the environment lives outside the current folder: its absolute path
        shown = str(activate)
    return f"source {shlex.quote(shown)}"


def _show_plan(plan) -> None:
    """The resolved plan (brief, or all of it with --verbose), then the memory verdict under it,
    and a warning when the run is no longer than its warm-ups (printed here, once the output
    folder and the data passed their checks: a refused run is one line)."""
    from zfctl.plan.advice import short_run_warnings

    print_run_plan(plan)
    _memory_line(plan)
    for line in short_run_warnings(plan):
        warning_line(line)


def _memory_line(plan) -> None:
    """The memory verdict under the plan (`zfctl plan` shows every line): a note when it fits, a
    warning naming the largest lines when it does not (the estimate is rough; the run goes on)."""
    from zfctl.plan.memory import estimate
    from zfctl.plan.render import verdict_line

    est = estimate(plan)
    if est.fits or est.size is None:
        console.print(verdict_line(est), style="dim")
    else:
        from zfctl.plan.fit import fit

        found = fit(plan)
        advice = f"; --fit would add {' '.join(c.flags for c in found.changes)}" if found.fits else ""
        warning_line(verdict_line(est) + advice + "; see `zfctl plan` for every line")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
