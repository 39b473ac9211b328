"""What ``zfctl finetune`` and ``zfctl resume`` do with a resolved request: train in this process,
or check everything once and launch the ranks under torchrun.

Each verb is one call here. A process that trains drives ``zfctl.train.session`` (``run`` or
``resume``); a failure there becomes one line naming the rank (``rank_error``, zfctl/train/dist.py).
With ``--nproc N`` outside torchrun the launch sequence is the same for both verbs: the run
folder passes :meth:`RunFolder.check <zfctl.train.rundir.RunFolder.check>` (and ``finetune``
prepares the data into the cache, so that the ranks load it instead of tokenising it N times),
then ``zfctl <the same arguments>`` is relaunched on N processes and its exit code returned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from zfctl.errors import UserError
from zfctl.plan.io import load_plan_yaml
from zfctl.plan.schema import RunPlan
from zfctl.quiet import is_verbose, torchrun_env
from zfctl.train import checkpoint as ck
from zfctl.train.dist import (
    PLAN_PRINTED_ENV,
    RESUME_FROM_ENV,
    RUN_DIR_ENV,
    DistEnv,
    dist_env,
    rank_error,
    relaunch,
    under_torchrun,
    worker_argv,
)
from zfctl.train.rundir import RunFolder

if TYPE_CHECKING:
    from zfctl.train.progress import RunResult


@dataclass(frozen=True)
class Launched:
    """The job ran under torchrun on this node; ``code`` is its exit code."""

    code: int


def finetune(plan: RunPlan, *, force: bool, debug_data: bool, argv: Sequence[str],
             show_plan: Callable[[RunPlan], None]) -> RunResult | Launched:
    """Fine-tune as ``plan`` says (``argv``: the command line, for a relaunch).

    Rank 0 of a job checks the output folder and the data's first record before ``show_plan``
    prints the plan (once per job: relaunched ranks stay quiet), so a mistake is one line in a
    second, not after the plan and a model load.
    """
    env = dist_env()
    first = env.is_main and not os.environ.get(PLAN_PRINTED_ENV)
    if first:
        from zfctl.train.preflight import preflight

        preflight(plan, force=force, output=not debug_data)
    if plan.distributed.nproc > 1 and not under_torchrun() and not debug_data:
        show_plan(plan)

        def prepare() -> None:  # the data lands in the cache: the ranks load it, never tokenise it again
            from zfctl.train.inputs import load_inputs
            from zfctl.train.metrics import require_sinks

            require_sinks(wandb=plan.logging.wandb, tensorboard=plan.logging.tensorboard)
            load_inputs(plan, rank=env.rank)

        folder = RunFolder(Path(plan.checkpoint.output_dir), force=force)  # only checked: rank 0 claims it
        return _launch(plan.distributed.nproc, worker_argv(argv, "distributed.nproc"), folder, prepare)
    if first:
        show_plan(plan)
    from zfctl.train import session  # the training side: imported only by a process that trains

    return _as_rank(env, plan.distributed.timeout, lambda: session.run(plan, force=force, debug_data=debug_data),
                    run_dir=Path(plan.checkpoint.output_dir))


def resume(ckpt_dir: Path, *, max_steps: int | None, allow_changes: bool, latest_good: bool, nproc: int | None,
           argv: Sequence[str], show_plan: Callable[[RunPlan], None],
           strategy: str | None = None) -> RunResult | Launched:
    """Continue a run from ``ckpt_dir`` on ``nproc`` processes (default: the checkpoint's world
    size; more than one relaunches under torchrun) under ``strategy`` (default: the saved one).
    ``show_plan`` prints the plan that will run, read from the checkpoint, before any data is loaded."""
    if not under_torchrun():
        notes: list[str] = []
        try:
            info: ck.CheckpointInfo | None = ck.resolve_checkpoint(ckpt_dir, notes, latest_good=latest_good)
        except UserError:
            info = None  # resume reports why, in one process
        saved = _saved_world_size(info, nproc, strategy)
        n = nproc if nproc is not None else (saved or 1)
        if n > 1 and info is not None:
            from zfctl.train.session import check_data_present, note, resuming_line

            done = _finished(info, max_steps=max_steps, allow_changes=allow_changes, world=n)
            if done is not None:  # said at once: no torchrun start only to find nothing to train
                return done
            for line in notes:
                note(line)
            if latest_good:
                note(f"resuming from the newest intact checkpoint, {info.path} (step {info.step})")
            with contextlib.suppress(UserError):  # an unreadable plan: each rank says why
                check_data_present(load_plan_yaml(info.path / ck.PLAN_FILE), info.path.parent.parent)
            # Printed here, before any rank can fail: the line a rank's error is read against.
            Console().print(resuming_line(info), highlight=False, markup=False, soft_wrap=True)
            # Resolved (and with --latest-good verified) once, here: the ranks load this folder.
            return _launch(n, worker_argv(argv), RunFolder(info.path.parent.parent, fresh=False),
                           extra_env={RESUME_FROM_ENV: str(info.path)})
    from zfctl.train import session

    return _as_rank(dist_env(), None, lambda: session.resume(
        ckpt_dir, max_steps=max_steps, allow_changes=allow_changes, on_plan=show_plan, latest_good=latest_good,
        strategy=strategy),
        run_dir=_run_folder_of(Path(os.environ.get(RESUME_FROM_ENV) or ckpt_dir)))


def _launch(nproc: int, argv: Sequence[str], folder: RunFolder,
            prepare: Callable[[], None] | None = None, extra_env: dict[str, str] | None = None) -> Launched:
    """Everything that can fail on user input, checked here once before N processes start; then
    the job. The folder is only checked: rank 0 locks and claims it once every rank is ready."""
    folder.check()
    if prepare is not None:
        prepare()
    threads = ""
    if is_verbose():  # torchrun's own banner says this in four lines; zfctl sets the value itself (quiet.py)
        threads = f", OMP_NUM_THREADS={torchrun_env(dict(os.environ))['OMP_NUM_THREADS']} each"
    Console().print(f"launching {nproc} processes under torchrun (standalone{threads})")
    # torchrun inherits this process's environment: its line for a rank that died without a word
    # says how to continue the run folder (zfctl/train/_torchrun.py)
    before = os.environ.get(RUN_DIR_ENV)
    os.environ[RUN_DIR_ENV] = str(folder.path)
    try:
        return Launched(relaunch(nproc, argv, extra_env))
    finally:
        if before is None:
            del os.environ[RUN_DIR_ENV]
        else:
            os.environ[RUN_DIR_ENV] = before


def _as_rank(env: DistEnv, timeout: float | None, work: Callable[[], RunResult], *, run_dir: Path) -> RunResult:
    """``work()``; a user error or a lost peer becomes one line naming this rank (and, for a lost
    peer, how to continue ``run_dir``), a bug stays as is."""
    try:
        return work()
    except Exception as e:
        if env.world_size > 1:  # torchrun's SIGTERM (a peer died) must not end us before our line
            from zfctl.train.signals import hold_signals

            hold_signals()
        named = rank_error(e, env, timeout, run_dir=run_dir)
        if named is e:
            raise
        raise named from None


def _finished(info: ck.CheckpointInfo, *, max_steps: int | None, allow_changes: bool,
              world: int) -> RunResult | None:
    """The result of a resume of ``info`` that has nothing to train (it is at the run's last
    step, or at ``max_steps``), found from the checkpoint's plan before any process starts; None
    when there is training to do, or when only the ranks can tell (``allow_changes``: the run
    folder's edited plan decides the length; a plan that cannot be read: the ranks say why)."""
    from zfctl.train.progress import RunResult
    from zfctl.train.run_length import run_length
    from zfctl.train.world_size import fit_world_size

    if allow_changes:
        return None
    try:
        end = max_steps if max_steps is not None else run_length(
            info, fit_world_size(load_plan_yaml(info.path / ck.PLAN_FILE), info.world_size, world)[0], world)
    except UserError:
        return None
    # --max-steps before the checkpoint's step is refused by the ranks, with its own line
    finished = end is not None and (info.step == end if max_steps is not None else info.step >= end)
    if not finished:
        return None
    return RunResult(output_dir=info.path.parent.parent, steps=info.step, final_train_loss=None,
                     final_eval_loss=None, last_checkpoint=info.path, already_finished=True)


def _run_folder_of(path: Path) -> Path:
    """The run folder of what ``zfctl resume`` was given: a checkpoint folder, ``checkpoints/``,
    or the run folder itself."""
    if (path / ck.META).is_file():
        return path.parent.parent
    return path.parent if path.name == ck.CHECKPOINTS else path


def _saved_world_size(info: ck.CheckpointInfo | None, nproc: int | None, strategy: str | None = None) -> int | None:
    """The world size recorded in the checkpoint; None if it cannot be read (resume reports why).

    ``nproc`` different from it: checked here, before N processes start, that the global batch can
    be kept (zfctl/train/world_size.py), rather than by each rank after torchrun formed the group;
    and that fsdp (saved, or ``strategy``) shards the model evenly over that many.
    """
    from zfctl.plan.validate import check_strategy
    from zfctl.train.world_size import fit_strategy, fit_world_size

    if info is None:
        return None
    changed = nproc not in (None, info.world_size) or strategy is not None
    try:
        plan = load_plan_yaml(info.path / ck.PLAN_FILE) if changed else None
    except UserError:
        return None
    if plan is not None:
        n = nproc if nproc is not None else info.world_size
        try:
            plan = fit_world_size(plan, info.world_size, n)[0]  # refuses only an --nproc given
        except UserError as e:
            raise UserError(f"--nproc {nproc}: {e}") from None
        plan, _ = fit_strategy(plan, strategy)  # its own line names --strategy
        check_strategy(plan)
    return info.world_size
