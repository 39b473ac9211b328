"""`run` and `resume`: build everything the loop needs from a RunPlan (or a checkpoint) and train.

Order matters for the promise "bad input -> one line, exit 2, nothing touched": every input is
proved good (tokenizer, data, model, optimizer) before the output folder is created or cleared.
Data is prepared before the process group forms, so a tokenisation error never leaves torchrun
peers hanging in a collective.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from zfctl import __version__
from zfctl.errors import UserError
from zfctl.plan.io import dump_plan_yaml, load_plan_yaml
from zfctl.plan.schema import RunPlan
from zfctl.plan.validate import check_max_length
from zfctl.train import checkpoint as ck
from zfctl.train.data.sampler import ResumableSampler, SamplerPosition
from zfctl.train.display import NullDisplay, RichDisplay
from zfctl.train.dist import DistEnv, dist_env
from zfctl.train.inputs import load_inputs
from zfctl.train.lock import RunLock, acquire
from zfctl.train.loop import LoopInputs, train
from zfctl.train.metrics import MetricsWriter, build_sinks, require_sinks
from zfctl.train.optim import build_optimizer
from zfctl.train.reshard import as_saved_world, fit_world_size, load_optimizer_state
from zfctl.train.rundir import check_output_dir, clear_run_dir, plan_differences
from zfctl.train.schedule import build_scheduler, restore_scheduler
from zfctl.writable import check_writable


@dataclass
class RunResult:
    """What a finished (or already finished) run reports to the CLI."""

    output_dir: Path
    steps: int
    final_train_loss: float | None
    final_eval_loss: float | None
    last_checkpoint: Path | None


def _device(plan: RunPlan, env: DistEnv) -> torch.device:
    want = plan.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is visible; use --set train.device=cpu")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


@contextlib.contextmanager
def _process_setup(plan: RunPlan, env: DistEnv, device: torch.device) -> Iterator[None]:
    """Seeds, determinism flags and the process group, restored/torn down on exit."""
    prev_det = torch.are_deterministic_algorithms_enabled()
    random.seed(plan.train.seed)
    torch.manual_seed(plan.train.seed)
    # CPU kernels are deterministic for a fixed thread count already; the flag makes any op
    # that is not warn instead of silently breaking bit-exact resume. On CUDA it would force
    # slower kernels (and needs CUBLAS_WORKSPACE_CONFIG), so it stays off there.
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    own_group = False
    if env.world_size > 1 and not dist.is_initialized():
        backend = plan.distributed.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
        own_group = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_det)
        if own_group:
            dist.destroy_process_group()


def _build_model(plan: RunPlan, device: torch.device) -> torch.nn.Module:
    from zfctl.train.models.load import load_model

    return load_model(plan.model, precision=plan.train.precision, device=device, seed=plan.train.seed)


def _total_steps(plan: RunPlan, sampler: ResumableSampler) -> int:
    if plan.train.max_steps is not None:
        return int(plan.train.max_steps)
    return max(1, plan.train.epochs * sampler.batches_per_epoch() // plan.train.gradient_accumulation_steps)


def _note(message: str) -> None:
    Console(stderr=True).print(f"note: {message}", style="yellow", highlight=False, markup=False,
                               soft_wrap=True)


@dataclass
class _FolderLock:
    """Rank 0's lock on the run folder, taken once (early if the folder exists, else on creation)."""

    held: RunLock | None = None

    def take(self, out: Path) -> None:
        if self.held is None:
            self.held = acquire(out, note=_note)

    def release(self) -> None:
        if self.held is not None:
            self.held.release()
            self.held = None


def _train(plan: RunPlan, *, prepared: Any, env: DistEnv, device: torch.device, fresh: bool,
           lock: _FolderLock, force: bool = False, ckpt: ck.CheckpointInfo | None = None) -> RunResult:
    """Shared body of run/resume: build, restore (resume), train."""
    out = Path(plan.checkpoint.output_dir)
    t = plan.train
    with _process_setup(plan, env, device):
        model = _build_model(plan, device)
        check_max_length(plan.data.max_length, getattr(model, "config", None))  # hub/local models
        position = None
        trainer_state: dict[str, Any] = {}
        if ckpt is not None:
            ck.load_model_weights(ckpt, model)
            trainer_state = ck.load_torch(ckpt, ck.TRAINER_FILE)
            position = SamplerPosition.from_dict(trainer_state["sampler"])
            if trainer_state.get("num_train_samples") not in (None, len(prepared.train)):
                raise UserError(
                    f"the training data changed since the checkpoint ({trainer_state['num_train_samples']} "
                    f"records then, {len(prepared.train)} now): the data position would be meaningless; "
                    "restore the data or start a new run")
        sampler = ResumableSampler(len(prepared.train), t.micro_batch_size, seed=t.seed, rank=env.rank,
                                   world_size=env.world_size, position=position)
        steps_per_epoch = max(1, sampler.batches_per_epoch() // t.gradient_accumulation_steps)
        total = _total_steps(plan, sampler)
        optimizer = build_optimizer(model, plan, steps_per_epoch=steps_per_epoch,
                                    process_group=dist.group.WORLD if env.world_size > 1 else None)
        metrics = display = None
        try:  # from here on the optimizer's CPU worker thread runs: always close it
            scheduler = build_scheduler(optimizer, t.schedule, warmup_steps=t.warmup_steps, total_steps=total)
            start_step = 0
            if ckpt is not None:
                load_optimizer_state(optimizer, ckpt, env.rank, env.world_size)  # re-cut if W changed
                restore_scheduler(scheduler, trainer_state["scheduler"])
                start_step = int(trainer_state["step"])
                rng = ckpt.path / ck.rng_file(env.rank)
                if rng.exists():  # RNG last: nothing above may draw from it after the restore
                    ck.restore_rng(ck.load_torch(ckpt, rng.name))

            # Every input is good: only now touch the output folder. First the disk: a checkpoint
            # that cannot fit is refused now, not after an hour of training (one line, exit 2).
            estimate = ck.estimate_bytes(model)
            if env.rank == 0:
                ck.check_run_space(out, estimate, reclaim=fresh and force)
            # Rank 0 holds the folder's lock from here (or from before) to the end: --force never
            # clears, and no second process writes into, a folder a live run holds.
            if env.rank == 0:
                if fresh:
                    check_output_dir(out, force)
                out.mkdir(parents=True, exist_ok=True)
                lock.take(out)
                if fresh:
                    check_output_dir(out, force)  # again, under the lock
                    clear_run_dir(out)
                dump_plan_yaml(plan, out / ck.PLAN_FILE)
            if env.world_size > 1:
                dist.barrier()
            if env.rank == 0:
                sinks = build_sinks(wandb=plan.logging.wandb, wandb_project=plan.logging.wandb_project,
                                    tensorboard=plan.logging.tensorboard, run_dir=out, config=asdict(plan))
                metrics = MetricsWriter(out, resume_step=None if fresh else start_step, sinks=sinks)
            display = RichDisplay(Console()) if env.rank == 0 else NullDisplay()

            def save(step: int, counters: dict[str, Any]) -> Path:
                state = {"step": step, "scheduler": scheduler.state_dict(),
                         "sampler": sampler.position.to_dict(), "num_train_samples": len(prepared.train),
                         "steps_per_epoch": steps_per_epoch,
                         "zfctl_version": __version__, **counters}
                return ck.save_checkpoint(
                    out, step, model=model, optimizer_state=optimizer.state_dict(), trainer_state=state,
                    write_plan=lambda p: dump_plan_yaml(plan, p), keep_last=plan.checkpoint.keep_last,
                    rank=env.rank, world_size=env.world_size,
                    barrier=dist.barrier if env.world_size > 1 else (lambda: None), estimate=estimate)

            result = train(LoopInputs(
                model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                train_data=prepared.train, eval_data=prepared.eval, collate=prepared.collate,
                device=device, start_step=start_step, total_steps=total,
                grad_accum=t.gradient_accumulation_steps, micro_batch_size=t.micro_batch_size,
                eval_every=t.eval_every, eval_batches=t.eval_batches,
                checkpoint_every=plan.checkpoint.every, log_every=max(1, plan.logging.every),
                save_checkpoint=save, metrics=metrics, display=display, run_dir=out, rank=env.rank,
                world_size=env.world_size, tokens_seen=int(trainer_state.get("tokens_seen", 0)),
                last_loss=trainer_state.get("last_loss"), guard_non_finite=t.precision != "fp16"))
        finally:
            if metrics is not None:
                metrics.close()
            if display is not None:
                display.close()
            optimizer.close()
    last = result.last_checkpoint or (ckpt.path if ckpt is not None else None)
    return RunResult(output_dir=out, steps=result.steps, final_train_loss=result.final_train_loss,
                     final_eval_loss=result.final_eval_loss, last_checkpoint=last)


def run(plan: RunPlan, *, force: bool = False, debug_data: bool = False) -> RunResult:
    """Fine-tune as ``plan`` says; write checkpoints and metrics under its output folder.

    ``debug_data``: print a few decoded training samples with their label masks and return
    without training or writing anything.
    """
    out = Path(plan.checkpoint.output_dir)
    env = dist_env()
    lock = _FolderLock()
    try:
        if not debug_data and env.rank == 0:
            # Fail in a second, before minutes of data preparation: the folder's state, a live
            # run in it, a destination that cannot be written, missing logger packages.
            check_output_dir(out, force)
            check_writable(out, "--output")
            if out.is_dir():
                lock.take(out)  # hold it through data preparation: nobody starts in between
            require_sinks(wandb=plan.logging.wandb, tensorboard=plan.logging.tensorboard)
        tokenizer, prepared = load_inputs(plan, rank=env.rank)
        if debug_data:
            from zfctl.train.data.prepare import format_debug_samples

            if env.rank == 0:
                Console().print(format_debug_samples(prepared, tokenizer), highlight=False, markup=False)
            return RunResult(output_dir=out, steps=0, final_train_loss=None, final_eval_loss=None,
                             last_checkpoint=None)
        return _train(plan, prepared=prepared, env=env, device=_device(plan, env), fresh=True,
                      lock=lock, force=force)
    finally:
        lock.release()


def resume(ckpt_dir: Path, *, max_steps: int | None = None, allow_changes: bool = False,
           on_plan: Callable[[RunPlan], None] | None = None, latest_good: bool = False) -> RunResult:
    """Continue a run from a checkpoint folder, or from a run folder's newest checkpoint.

    The plan comes from the checkpoint. A run-folder ``plan.yaml`` edited since is refused with
    the differences listed unless ``allow_changes`` (then the edited plan is used). A different
    world size re-cuts the optimizer state and keeps the global batch by changing the gradient
    accumulation, or is refused when it cannot (``zfctl.train.reshard``). ``max_steps``
    moves the end of the run (the LR schedule follows it).
    ``on_plan`` receives the plan that will run (the CLI prints it) before any data is loaded.
    Every file this process reads is checked against its digest first (one read each); a damaged
    one is refused naming the nearest intact older checkpoint. ``latest_good``: for a run folder,
    take the newest checkpoint that verifies, skipping damaged newer ones.
    """
    env = dist_env()
    notes: list[str] = []
    info = ck.resolve_checkpoint(Path(ckpt_dir), notes, latest_good=latest_good)
    run_dir = info.path.parent.parent
    lock = _FolderLock()
    if env.rank == 0:
        for note in notes:
            _note(note)
        if latest_good:
            _note(f"resuming from the newest intact checkpoint, {info.path} (step {info.step})")
        check_writable(run_dir, "CKPT_DIR", "resume needs to write checkpoints and metrics there")
        lock.take(run_dir)  # before loading the checkpoint: a live run may be rotating it away
    try:
        return _resume(info, run_dir, env, lock, max_steps=max_steps, allow_changes=allow_changes,
                       on_plan=on_plan)
    finally:
        lock.release()


def _resume(info: ck.CheckpointInfo, run_dir: Path, env: DistEnv, lock: _FolderLock, *,
            max_steps: int | None, allow_changes: bool,
            on_plan: Callable[[RunPlan], None] | None) -> RunResult:
    ck.verify_checkpoint(info, [ck.PLAN_FILE, ck.MODEL_FILE, ck.TRAINER_FILE, ck.optimizer_file(env.rank),
                                ck.rng_file(env.rank)])
    plan = load_plan_yaml(info.path / ck.PLAN_FILE)
    problems = []
    edited = run_dir / ck.PLAN_FILE
    if edited.is_file():
        current = as_saved_world(load_plan_yaml(edited), plan)  # an earlier resume's nproc is no edit
        diffs = plan_differences(plan, current)
        if diffs and allow_changes:
            plan = current
        problems += diffs
    plan, resharded = fit_world_size(plan, info.world_size, env.world_size)  # zfctl/train/reshard.py
    if problems and not allow_changes:
        raise UserError(f"cannot resume {info.path}: the run changed since the checkpoint "
                        f"({'; '.join(problems)}); undo the change or pass --allow-changes")
    if resharded and env.rank == 0:
        _note(resharded)
    if info.version != __version__ and env.rank == 0:
        Console(stderr=True).print(f"[yellow]note: checkpoint written by zfctl {info.version}, this is "
                                   f"{__version__}")
    plan = replace(plan, checkpoint=replace(plan.checkpoint, output_dir=str(run_dir)))
    if max_steps is not None:
        if max_steps < info.step:
            raise UserError(f"--max-steps {max_steps} is before the checkpoint's step {info.step}; "
                            f"give a value >= {info.step}")
        plan = replace(plan, train=replace(plan.train, max_steps=max_steps))
    if on_plan is not None and env.rank == 0:
        on_plan(plan)
    if env.rank == 0:
        Console().print(f"resuming from {info.path} (step {info.step}, saved "
                        f"{info.meta.get('saved_at', '?')})", highlight=False, markup=False, soft_wrap=True)
    require_sinks(wandb=plan.logging.wandb, tensorboard=plan.logging.tensorboard)
    _, prepared = load_inputs(plan, rank=env.rank)
    return _train(plan, prepared=prepared, env=env, device=_device(plan, env), fresh=False, lock=lock,
                  ckpt=info)
