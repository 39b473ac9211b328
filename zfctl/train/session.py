"""`run` and `resume`: the two ways into one run lifecycle (zfctl/train/recipe.py).

Both check what they can cheaply, prepare the data, and drive a :class:`FinetuneRecipe` through
``load_checkpoint -> setup -> train -> cleanup``; they differ only in the checkpoint they load
(none for ``run``, the resolved one for ``resume``). Order matters for the promise "bad input ->
one line, exit 2, nothing touched": every input is proved good (tokenizer, data, checkpoint,
model, optimizer state) before the output folder is created or cleared, which the recipe does
last in ``setup``. Data is prepared before the process group forms (in ``setup``), so a
tokenisation error never leaves torchrun peers hanging in a collective. Rank 0 holds the run
folder's lock from before data preparation (an existing folder, a resume) or from the folder's
creation to the end.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from zfctl import __version__
from zfctl.errors import UserError
from zfctl.plan.holds import check_holds
from zfctl.plan.io import load_plan_yaml
from zfctl.plan.schema import RunPlan
from zfctl.plan.settle import adopt_resolved, settle, unsettled
from zfctl.plan.validate import check_strategy
from zfctl.train import checkpoint as ck
from zfctl.train.dist import RESUME_FROM_ENV, DistEnv, dist_env, train_device
from zfctl.train.fsdp import resolve_strategy, shard_place
from zfctl.train.inputs import load_inputs
from zfctl.train.lock import FolderLock
from zfctl.train.metrics import require_sinks
from zfctl.train.progress import RunResult
from zfctl.train.recipe import FinetuneRecipe
from zfctl.train.run_length import check_new_length, run_length
from zfctl.train.rundir import RunFolder, plan_differences
from zfctl.train.world_size import as_saved_world, fit_strategy, fit_world_size, model_files

__all__ = ["RunResult", "resume", "run"]


def note(message: str) -> None:
    Console(stderr=True).print(f"note: {message}", style="yellow", highlight=False, markup=False,
                               soft_wrap=True)


def _lifecycle(recipe: FinetuneRecipe, ckpt: ck.CheckpointInfo | None) -> RunResult:
    """The run lifecycle, the same for a fresh run (``ckpt`` None) and a resumed one."""
    with recipe:  # cleanup() on the way out, however it ends
        recipe.load_checkpoint(ckpt)
        recipe.setup()
        return recipe.train()


def run(plan: RunPlan, *, force: bool = False, debug_data: bool = False) -> RunResult:
    """Fine-tune as ``plan`` says; write checkpoints and metrics under its output folder.

    ``debug_data``: print a few decoded training samples with their label masks and return
    without training or writing anything.
    """
    out = Path(plan.checkpoint.output_dir)
    env = dist_env()
    if not debug_data:  # every rank, on its own GPU: one line before anything is allocated or written
        check_holds(plan, train_device(plan, env))
    lock = FolderLock(note=note)
    try:
        if not debug_data and env.rank == 0:
            # Fail in a second, before minutes of data preparation: the folder's state, a live
            # run in it, a destination that cannot be written, missing logger packages.
            folder = RunFolder(out, force=force)
            folder.check()
            folder.hold(lock)
            require_sinks(wandb=plan.logging.wandb, tensorboard=plan.logging.tensorboard)
        tokenizer, prepared = load_inputs(plan, rank=env.rank)
        if debug_data:
            from zfctl.train.data.prepare import format_debug_samples

            if env.rank == 0:
                Console().print(format_debug_samples(prepared, tokenizer), highlight=False, markup=False)
            return RunResult(output_dir=out, steps=0, final_train_loss=None, final_eval_loss=None,
                             last_checkpoint=None)
        return _lifecycle(FinetuneRecipe(plan, prepared, env, lock=lock, force=force), None)
    finally:
        lock.release()


def resume(ckpt_dir: Path, *, max_steps: int | None = None, allow_changes: bool = False,
           on_plan: Callable[[RunPlan], None] | None = None, latest_good: bool = False,
           strategy: str | None = None) -> RunResult:
    """Continue a run from a checkpoint folder, or from a run folder's newest checkpoint.

    The plan comes from the checkpoint. A run-folder ``plan.yaml`` edited since is refused with
    the differences listed unless ``allow_changes`` (then the edited plan is used). A different
    world size keeps the global batch by changing the gradient accumulation, or is refused when it
    cannot (``zfctl.train.world_size``); ``strategy`` (``--strategy``; None: the saved one) changes
    ``distributed.strategy`` the same way; ``FinetuneRecipe.setup`` re-cuts the model and optimizer
    state. ``max_steps`` moves the end of the run; one that changes the LR of a step still to run is
    refused unless ``allow_changes`` (zfctl/train/run_length.py). A checkpoint at the run's last
    step returns at once with ``already_finished``: nothing is loaded, trained or evaluated.
    ``on_plan`` receives the plan that will run (the CLI prints it) before any data is loaded.
    Every file this process reads is checked against its digest first (one read each); a damaged
    one is refused naming the nearest intact older checkpoint. ``latest_good``: for a run folder,
    take the newest checkpoint that verifies, skipping damaged newer ones.
    """
    env = dist_env()
    notes: list[str] = []
    launched = os.environ.get(RESUME_FROM_ENV)  # the launcher's resolution (launch.py), one for all ranks
    info = ck.read_checkpoint(Path(launched)) if launched else ck.resolve_checkpoint(Path(ckpt_dir), notes,
                                                                                   latest_good=latest_good)
    run_dir = info.path.parent.parent
    lock = FolderLock(note=note)
    if env.rank == 0:
        for line in notes:
            note(line)
        if latest_good and not launched:  # the launcher said it
            note(f"resuming from the newest intact checkpoint, {info.path} (step {info.step})")
        folder = RunFolder(run_dir, fresh=False)
        folder.check()
        folder.hold(lock)  # before loading the checkpoint: a live run may be rotating it away
    try:
        # --latest-good chose a checkpoint whose every file verified just now (here or in the launcher)
        plan = _resumed_plan(info, run_dir, env, max_steps=max_steps, allow_changes=allow_changes,
                             verified=latest_good, strategy=strategy)
        length = run_length(info, plan, env.world_size)
        if length is not None and info.step >= length:  # nothing to train: say so, instead of loading and evaluating
            return RunResult(output_dir=run_dir, steps=info.step, final_train_loss=None, final_eval_loss=None,
                             last_checkpoint=info.path, already_finished=True)
        check_data_present(plan, run_dir)  # before the plan prints: a refusal is one line
        check_holds(plan, train_device(plan, env), resume=str(run_dir))  # every rank, its own GPU
        if on_plan is not None and env.rank == 0:
            on_plan(plan)
        if env.rank == 0 and not launched:  # the launcher printed it before any rank started
            Console().print(resuming_line(info), highlight=False, markup=False, soft_wrap=True)
        require_sinks(wandb=plan.logging.wandb, tensorboard=plan.logging.tensorboard)
        _, prepared = load_inputs(plan, rank=env.rank)
        return _lifecycle(FinetuneRecipe(plan, prepared, env, lock=lock, allow_changes=allow_changes), info)
    finally:
        lock.release()


def resuming_line(info: ck.CheckpointInfo) -> str:
    """The line a resume starts with: the checkpoint it continues."""
    return f"resuming from {info.path} (step {info.step}, saved {info.meta.get('saved_at', '?')})"


def check_data_present(plan: RunPlan, run_dir: Path) -> None:
    """Refuse, naming the file and how to bring it back, a resume whose training data is gone:
    ``resume`` has no --data, and the checkpoint continues on the same records (a data set that
    changed is refused by its digest, zfctl/train/progress.py)."""
    d = plan.data
    if d.source != "local" or not d.path:
        return
    for key, name in (("data.path", d.path), ("data.validation_split", d.validation_split)):
        if name is None or key == "data.validation_split" and not Path(name).expanduser().is_absolute():
            continue  # a split name, or a sibling file: checked with the data when it is read
        path = Path(name).expanduser()
        if not path.exists():
            raise UserError(f"cannot resume {run_dir}: its training data {path} ({key} in its plan) is gone; put "
                            "the file back at that path (the run continues on the same records), or set "
                            f"{key} in {run_dir / ck.PLAN_FILE} to where it is now and resume with --allow-changes")


def _run_folder_plan(path: Path, renamed: list[str], *, allow_changes: bool, rank: int) -> RunPlan | None:
    """The run folder's plan.yaml, the user's place to edit a run (None: there is none). One that
    cannot be read blocks nothing: the checkpoint holds its own digest-checked copy, which the
    resume then writes back over it. Only ``allow_changes``, which asks for the edited plan,
    needs it readable."""
    if not path.is_file():
        return None
    try:
        return load_plan_yaml(path, renamed)
    except (UserError, OSError) as e:
        if allow_changes:
            raise UserError(f"--allow-changes resumes with the edited {path}, which cannot be read: {e}; fix "
                            "it, or resume without --allow-changes to use the checkpoint's plan") from None
        if rank == 0:
            note(f"{path} cannot be read ({e}); resuming with the checkpoint's copy of the plan, which "
                 "replaces it")
        return None


def _resumed_plan(info: ck.CheckpointInfo, run_dir: Path, env: DistEnv, *, max_steps: int | None,
                  allow_changes: bool, verified: bool = False, strategy: str | None = None) -> RunPlan:
    """The plan a resume runs: the checkpoint's (its files this rank reads verified first, unless
    ``verified``: every file was), or the run folder's edited one with ``allow_changes``; refused
    if it changed without it. ``strategy``: ``distributed.strategy`` to run under (None: kept)."""
    if not verified:
        ck.verify_checkpoint(info, [ck.PLAN_FILE, ck.TRAINER_FILE,
                                    ck.optimizer_file_in(info, env.rank), ck.rng_file(env.rank)])
    renamed: list[str] = []  # keys of an older zfctl, mapped alike in both plans (zfctl/plan/legacy.py)
    plan = load_plan_yaml(info.path / ck.PLAN_FILE, renamed)
    problems = []
    edited = run_dir / ck.PLAN_FILE
    current = _run_folder_plan(edited, renamed, allow_changes=allow_changes, rank=env.rank)
    if current is not None:
        current = as_saved_world(current, plan)  # an earlier resume's nproc is no edit
        plan = adopt_resolved(plan, current)  # an older checkpoint's auto, which a later resume settled: no edit
        diffs = plan_differences(plan, current)
        if diffs and allow_changes:
            plan = current
        problems += diffs
    plan, resharded = fit_world_size(plan, info.world_size, env.world_size)  # zfctl/train/world_size.py
    plan, restrategy = fit_strategy(plan, strategy)
    if env.world_size == 1 and plan.distributed.strategy == "fsdp":  # what trains: the plan says it
        plan = replace(plan, distributed=replace(plan.distributed, strategy="zero2"))
        restrategy = (f"{restrategy}; " if restrategy else "") + (
            "distributed.strategy=fsdp on one process: nothing to shard over, so the run continues as zero2 "
            "(the plan says so); resume with --nproc N (N > 1) --strategy fsdp to shard it again")
    if problems and not allow_changes:
        raise UserError(f"cannot resume {info.path}: the run changed since the checkpoint "
                        f"({'; '.join(problems)}); undo the change or pass --allow-changes")
    if strategy is not None:
        check_strategy(plan)  # fsdp on a world size that does not divide: refused before any load
    if not verified:  # the model and optimizer files this rank reads, in the layout they were saved in
        strategy_now = resolve_strategy(plan, env.world_size)
        rank, world = shard_place(plan, strategy_now, env.rank, env.world_size, env.local_world_size)
        ck.verify_checkpoint(info, [*model_files(info, rank, world, strategy_now), ck.optimizer_file_in(info, rank)])
    for line in (resharded, restrategy):
        if line and env.rank == 0:
            note(line)
    if env.rank == 0:
        for line in dict.fromkeys(renamed):
            note(line)
    if info.version != __version__ and env.rank == 0:
        Console(stderr=True).print(f"[yellow]note: checkpoint written by zfctl {info.version}, this is "
                                   f"{__version__}")
    plan = replace(plan, checkpoint=replace(plan.checkpoint, output_dir=str(run_dir)))
    # A plan.yaml of an earlier zfctl may still say auto: decided now, once, for the machine the
    # plan names, and saved by this run (zfctl/plan/settle.py); a settled plan is read back as is.
    plan = settle(plan) if unsettled(plan) else plan
    if max_steps is not None:
        if max_steps < info.step:
            raise UserError(f"--max-steps {max_steps} is before the checkpoint's step {info.step}; "
                            f"give a value >= {info.step}")
        stretched = check_new_length(info, plan, max_steps, allow_changes=allow_changes)
        if stretched and env.rank == 0:
            note(stretched)
        plan = replace(plan, train=replace(plan.train, max_steps=max_steps))
    return plan
