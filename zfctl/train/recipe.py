"""One training run, as an object with a lifecycle named after torchtune's recipe interface.

``zfctl.train.session``'s ``run`` and ``resume`` drive a :class:`FinetuneRecipe` the same way and
differ only in the checkpoint they give :meth:`~FinetuneRecipe.load_checkpoint` (None: a fresh
run)::

    with FinetuneRecipe(plan, data, env, lock=lock) as recipe:  # cleanup() on the way out
        recipe.load_checkpoint(ckpt)
        recipe.setup()
        result = recipe.train()  # calls save_checkpoint(step) when one is due

``load_checkpoint`` comes first, as in torchtune (whose ``setup`` reads the checkpoint before
building anything): what it refuses (changed training data) is refused before the process
group forms, so torchrun peers are never left waiting in a collective, and
before anything is built. ``setup`` builds the parts, puts the checkpoint's state into them and,
last, with every input proved good, claims the output folder. ``train`` is the loop, one linear
method. ``cleanup`` closes what ``setup`` opened, newest first, however far it got.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from rich.console import Console
from typing_extensions import Self

from zfctl import __version__
from zfctl.errors import RunFailed, UserError
from zfctl.plan.io import dump_plan_yaml
from zfctl.plan.schema import RunPlan
from zfctl.plan.validate import check_max_length
from zfctl.train import checkpoint as ck
from zfctl.train.data.sampler import ResumableSampler, SamplerPosition
from zfctl.train.display import Display, NullDisplay, RichDisplay, format_eval_line, format_train_line
from zfctl.train.dist import DistEnv, process_setup, train_device
from zfctl.train.lock import FolderLock
from zfctl.train.loss import all_reduce_sum, evaluate, lm_loss_sum, model_inputs, targets, to_device
from zfctl.train.metrics import MetricsWriter, StepTimer, build_sinks, memory_stats
from zfctl.train.models.load import load_model
from zfctl.train.optim import TrainingOptimizer, build_optimizer
from zfctl.train.rundir import check_output_dir, clear_run_dir
from zfctl.train.schedule import build_scheduler, restore_scheduler
from zfctl.train.signals import StopSignals, interrupted
from zfctl.train.testhooks import fail_or_hang
from zfctl.train.world_size import load_optimizer_state

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LambdaLR

    from zfctl.train.data.prepare import PreparedData


@dataclass
class RunResult:
    """What a finished (or already finished) run reports to the CLI."""

    output_dir: Path
    steps: int
    final_train_loss: float | None
    final_eval_loss: float | None
    last_checkpoint: Path | None


@dataclass
class Progress:
    """Where the run stands; restored from ``trainer.pt``, advanced by the loop, saved with it."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # totals continue across resumes
    last_loss: float | None = None  # the last step's loss (reported if no step is left to run)


@dataclass
class _Restore:
    """What :meth:`FinetuneRecipe.load_checkpoint` read, for ``setup`` to put into the parts."""

    checkpoint: ck.CheckpointInfo  # the model weights are read from it straight into the model
    sampler: SamplerPosition
    scheduler: dict[str, Any]
    rng: dict[str, Any] | None  # None: the checkpoint has no RNG file for this rank


class FinetuneRecipe:
    """Fine-tuning ``plan`` on ``data`` in this process (one rank of ``env``).

    The parts below are built by :meth:`setup`; reading one before that is a bug. ``progress``,
    ``resumed_from`` and ``last_checkpoint`` are set by :meth:`load_checkpoint` and kept current
    by :meth:`train` and :meth:`save_checkpoint`. ``lock`` is the run folder's lock; the caller
    may have taken it already (it is taken when the folder is claimed otherwise) and releases it.
    ``force``: a fresh run may replace an existing run folder's contents.
    """

    model: torch.nn.Module
    sampler: ResumableSampler
    optimizer: TrainingOptimizer  # zfctl/train/optim.py: the seam to the ZenFlow engine
    scheduler: LambdaLR  # zfctl/train/schedule.py
    steps_per_epoch: int
    total_steps: int
    metrics: MetricsWriter | None  # None on ranks other than 0
    display: Display

    def __init__(self, plan: RunPlan, data: PreparedData, env: DistEnv, *, lock: FolderLock | None = None,
                 force: bool = False) -> None:
        self.plan, self.data, self.env = plan, data, env
        self.device = train_device(plan, env)
        self.run_dir = Path(plan.checkpoint.output_dir)
        self.lock = lock if lock is not None else FolderLock()
        self.force = force
        self.progress = Progress()
        self.resumed_from: ck.CheckpointInfo | None = None
        self.last_checkpoint: Path | None = None  # the newest checkpoint of this run's state
        self.saved_step: int | None = None  # its step
        self._restore: _Restore | None = None
        self._checkpoint_bytes = 0  # expected size of a checkpoint before the first is written
        self._cleanup = contextlib.ExitStack()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    # -- load_checkpoint ------------------------------------------------------------------------

    def load_checkpoint(self, ckpt: ck.CheckpointInfo | None) -> None:
        """Read what training continues from: nothing (a fresh run: step 0, the plan's seed), or
        ``ckpt``, whose files the caller has verified against their digests.

        Refuses, before anything is built, a checkpoint this process cannot continue: training
        data with another number of records (the data position would be meaningless). A world
        size other than the checkpoint's was fitted into the plan already (``_resumed_plan`` in
        session.py, zfctl/train/world_size.py); the optimizer state is re-cut for it in
        :meth:`setup`, which needs the built optimizer to know this rank's columns. Nothing is
        put into the parts yet: :meth:`setup` does that as it builds them.
        """
        if ckpt is None:
            return
        trainer = ck.load_torch(ckpt, ck.TRAINER_FILE)
        n_records = len(self.data.train)
        if trainer.get("num_train_samples") not in (None, n_records):
            raise UserError(
                f"the training data changed since the checkpoint ({trainer['num_train_samples']} records "
                f"then, {n_records} now): the data position would be meaningless; restore the data or "
                "start a new run")
        rng = ck.rng_file(self.env.rank)
        self._restore = _Restore(
            checkpoint=ckpt, sampler=SamplerPosition.from_dict(trainer["sampler"]),
            scheduler=trainer["scheduler"],
            rng=ck.load_torch(ckpt, rng) if (ckpt.path / rng).exists() else None)
        self.progress = Progress(step=int(trainer["step"]), tokens_seen=int(trainer.get("tokens_seen", 0)),
                                 last_loss=trainer.get("last_loss"))
        self.resumed_from, self.last_checkpoint, self.saved_step = ckpt, ckpt.path, ckpt.step

    # -- setup ----------------------------------------------------------------------------------

    def setup(self) -> None:
        """Seeds and the process group, then model, sampler, optimizer and LR scheduler, each with
        the checkpoint's state when resuming; last, the output folder, metrics and console."""
        plan, t, env, restore = self.plan, self.plan.train, self.env, self._restore
        self._cleanup.enter_context(process_setup(plan, env, self.device))
        self.model = load_model(plan.model, precision=t.precision, device=self.device, seed=t.seed)
        check_max_length(plan.data.max_length, getattr(self.model, "config", None))  # hub/local models
        if restore is not None:
            ck.load_model_weights(restore.checkpoint, self.model)
        self.sampler = ResumableSampler(len(self.data.train), t.micro_batch_size, seed=t.seed, rank=env.rank,
                                        world_size=env.world_size,
                                        position=restore.sampler if restore is not None else None)
        self.steps_per_epoch = max(1, self.sampler.batches_per_epoch() // t.gradient_accumulation_steps)
        self.total_steps = (int(t.max_steps) if t.max_steps is not None else
                            max(1, t.epochs * self.sampler.batches_per_epoch() // t.gradient_accumulation_steps))
        optimizer = build_optimizer(self.model, plan, steps_per_epoch=self.steps_per_epoch,
                                    process_group=dist.group.WORLD if env.world_size > 1 else None)
        self.optimizer = optimizer
        self._cleanup.callback(optimizer.close)  # its CPU worker thread runs from here on
        self.scheduler = build_scheduler(optimizer, t.schedule, warmup_steps=t.warmup_steps,
                                         total_steps=self.total_steps)
        if restore is not None:
            self._install(restore)
            self._restore = None  # the optimizer state read from disk is not needed any more
        self._claim_run_folder()

    def _install(self, restore: _Restore) -> None:
        """Put the checkpoint's optimizer, scheduler and RNG state into the freshly built parts."""
        # This rank's columns, from whichever saved ranks' files hold them (re-cut when the world
        # size changed); a state that does not fit this plan is a one-line UserError.
        load_optimizer_state(self.optimizer, restore.checkpoint, self.env.rank, self.env.world_size)
        restore_scheduler(self.scheduler, restore.scheduler)
        if restore.rng is not None:  # RNG last: nothing above may draw from it after the restore
            ck.restore_rng(restore.rng)

    def _claim_run_folder(self) -> None:
        """Every input is good: only now touch the output folder (rank 0 writes, all wait)."""
        out, env, fresh = self.run_dir, self.env, self.resumed_from is None
        # First the disk: a checkpoint that cannot fit is refused now, not after an hour of
        # training (one line, exit 2).
        self._checkpoint_bytes = ck.estimate_bytes(self.model)
        if env.rank == 0:
            ck.check_run_space(out, self._checkpoint_bytes, reclaim=fresh and self.force)
            # Rank 0 holds the folder's lock from here (or from before) to the end: --force never
            # clears, and no second process writes into, a folder a live run holds. A resumed
            # run continues in its own folder; a fresh one needs it empty or --force.
            if fresh:
                check_output_dir(out, self.force)
            out.mkdir(parents=True, exist_ok=True)
            self.lock.take(out)
            if fresh:
                check_output_dir(out, self.force)  # again, under the lock
                clear_run_dir(out)
            dump_plan_yaml(self.plan, out / ck.PLAN_FILE)
        self._barrier()
        self.metrics = None
        if env.rank == 0:
            sinks = build_sinks(wandb=self.plan.logging.wandb, wandb_project=self.plan.logging.wandb_project,
                                tensorboard=self.plan.logging.tensorboard, run_dir=out, config=asdict(self.plan))
            # A resumed run drops the records after its checkpoint's step (a crashed run wrote them).
            metrics = MetricsWriter(out, resume_step=None if fresh else self.progress.step, sinks=sinks)
            self.metrics = metrics
            self._cleanup.callback(metrics.close)
        self.display = RichDisplay(Console()) if env.rank == 0 else NullDisplay()
        self._cleanup.callback(self.display.close)

    def _barrier(self) -> None:
        if self.env.world_size > 1:
            dist.barrier()

    # -- train ----------------------------------------------------------------------------------

    def train(self) -> RunResult:
        """Optimizer steps ``progress.step + 1 .. total_steps``, top to bottom. Per step:

        1. draw ``gradient_accumulation_steps`` micro-batches from the resumable sampler (host only);
        2. forward + backward each, the loss normalised by the step's number of target tokens;
        3. ``optimizer.step()`` (ZenFlow: device AdamW on the selected columns, the rest to the
           CPU), then the LR scheduler;
        4. one device->host sync for the loss, a metrics record, a console line every N steps;
        5. the non-finite guard: a NaN/inf loss or gradient norm stops the run before any
           checkpoint (except under fp16, whose loss scaler skips such steps by design);
        6. evaluation / checkpoint when due, or when a stop signal arrived.

        At the end: a checkpoint of the exact training state, then ``optimizer.flush()`` (installs
        an in-flight CPU update into the weights) and the final evaluation of the finished model.
        """
        model, opt, data, p = self.model, self.optimizer, self.data, self.progress
        t, rank, world_size, device = self.plan.train, self.env.rank, self.env.world_size, self.device
        grad_accum, total, start = t.gradient_accumulation_steps, self.total_steps, p.step
        eval_every, checkpoint_every = t.eval_every, self.plan.checkpoint.every
        log_every = max(1, self.plan.logging.every)
        guard_non_finite = t.precision != "fp16"  # fp16's loss scaler skips overflowing steps itself
        model.train()
        eval_loss = None
        timer = StepTimer(device)
        stop = StopSignals(
            on_first=lambda s: self.display.print(
                "[yellow]stop requested: finishing this step and writing a checkpoint "
                "(press Ctrl-C again to abort without one)"),
            abort_message=lambda s: None if rank != 0 else "no checkpoint was written; " + (
                f"the newest in {self.run_dir} is step {self.saved_step} (continue: zfctl resume "
                f"{self.run_dir})" if self.saved_step else f"{self.run_dir} has none yet"))

        window: list[float] = []  # losses since the last console line: the line shows their mean
        self.display.start(total, start)
        if start == 0 and eval_every > 0:  # the baseline the falling eval loss is read against
            self._log_eval(0, self._evaluate())
        with stop:
            while p.step < total:
                t_step = time.perf_counter()
                # -- data: the whole step's micro-batches first, so the loss can be normalised by
                #    the step's total target-token count (each token weighs the same regardless of
                #    how the step is cut into micro-batches). Host-only work, no device sync.
                batches = [data.collate([data.train[i] for i in self.sampler.next_indices()])
                           for _ in range(grad_accum)]
                n_targets: float = max(1, sum(targets(b) for b in batches))
                if world_size > 1:
                    # Divide by the global target count / world_size, not by this rank's: after the
                    # optimizer averages gradients over ranks, every token then weighs the same
                    # whichever rank saw it (the 1-process loss of the global batch). One tiny
                    # all-reduce before the forward; on NCCL it is a host<->device sync as well.
                    n_targets = max(1.0, all_reduce_sum([float(n_targets)], device, world_size)[0])
                    n_targets /= world_size
                n_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
                lr = opt.param_groups[0]["lr"]  # the LR this step uses (the scheduler moves it after)

                # -- forward / backward ("device compute"). With several processes the optimizer
                #    averages the gradients over ranks in step() (see n_targets above).
                timer.start()
                step_loss = torch.zeros((), device=device)
                for i, batch in enumerate(batches):
                    batch = to_device(batch, device)
                    logits = model(**model_inputs(batch), use_cache=False).logits
                    micro_loss = lm_loss_sum(logits, batch["labels"]) / n_targets
                    # The last backward's gradients are final: they stream to the host during it
                    # (zfctl/offload/stream.py), overlapped with the rest of the backward pass.
                    opt.prepare_backward(final=i == len(batches) - 1)
                    opt.scale_loss(micro_loss).backward()  # x loss scale under fp16, identity otherwise
                    step_loss += micro_loss.detach()
                    del logits, micro_loss  # free the activations' largest tensor before the next one
                timer.stop()
                fail_or_hang(self.env.rank, p.step + 1)  # tests only: zfctl/train/testhooks.py

                # -- optimizer: ZenFlow updates the selected columns on the device and hands the
                #    rest to its CPU worker; stats say how long it waited for that worker.
                stats = opt.step()
                self.scheduler.step()
                opt.zero_grad(set_to_none=True)
                p.step += 1
                step = p.step
                # The step's one deliberate device->host sync. Distributed, one small all-reduce
                # more (free for one process): the logged loss is the mean over ranks, tokens their
                # sum, and every rank learns of a stop request, so all checkpoint at the same step.
                loss, step_tokens, votes = all_reduce_sum(
                    [float(step_loss), float(n_tokens), float(stop.requested)], device, world_size)
                loss, step_tokens, stopping = loss / world_size, int(step_tokens), votes > 0
                if hasattr(stats, "resolve"):  # StepStats' device timings: read after the sync above, free
                    stats.resolve()
                p.last_loss = loss
                p.tokens_seen += step_tokens
                step_ms = (time.perf_counter() - t_step) * 1e3

                # -- metrics (rank 0) and the console line every log_every steps.
                if self.metrics is not None:
                    rec = {"kind": "train", "step": step, "loss": loss, "lr": lr,
                           "tokens": step_tokens, "tokens_seen": p.tokens_seen,
                           "tokens_per_s": step_tokens / max(step_ms, 1e-6) * 1e3,
                           "step_ms": step_ms, "compute_ms": timer.ms(),
                           "device_opt_ms": stats.device_opt_ms, "stall_ms": stats.stall_ms,
                           # share of the step the device had work: fwd/bwd + device optimizer
                           "gpu_busy": min(1.0, (timer.ms() + stats.device_opt_ms) / max(step_ms, 1e-6)),
                           "cpu_step_ms": stats.cpu_step_ms, "boundary": stats.boundary,
                           "selection": stats.selection, "warmup": stats.warmup,
                           "skipped": stats.skipped, "selected_fraction": stats.selected_fraction,
                           "grad_norm": stats.grad_norm, "loss_scale": stats.loss_scale,
                           "update_interval": stats.update_interval, "d2h_bytes": stats.d2h_bytes,
                           "h2d_bytes": stats.h2d_bytes, "epoch": self.sampler.position.epoch,
                           **memory_stats(device)}
                    if world_size > 1:  # bytes rank 0 sent to the group (StepStats.comm_bytes)
                        rec["comm_bytes"] = stats.comm_bytes
                    self.metrics.log(rec)
                    window.append(loss)
                    if step % log_every == 0 or step == start + 1 or step == total:
                        self.display.print(format_train_line({**rec, "loss": sum(window) / len(window),
                                                              "loss_steps": len(window)}, total))
                        window.clear()
                self.display.advance(step, loss)

                # -- non-finite guard: the step's update already used the NaN/inf gradient, so this
                #    state must never become a checkpoint (nor push a good one out of keep_last).
                #    Every rank sees the same all-reduced loss and the same averaged-gradient norm.
                if guard_non_finite and not (math.isfinite(loss) and _finite(stats.grad_norm)):
                    self.display.close()
                    raise self._diverged(step, loss, stats.grad_norm, lr)

                # -- evaluation (the last step's is done after flush, on the finished model).
                if eval_every > 0 and step % eval_every == 0 and step < total:
                    eval_loss = self._evaluate()
                    self._log_eval(step, eval_loss)

                # -- checkpoint when due, or when a stop was requested (on any rank, see above).
                due = checkpoint_every > 0 and step % checkpoint_every == 0 and step < total
                if due or stopping:
                    self.save_checkpoint(step)
                if stopping:
                    exc = interrupted(stop.signum or 15, step, str(self.run_dir))
                    self.display.print(f"[yellow]{exc.message}")
                    self.display.close()
                    raise exc

        # -- end: save the exact training state first (a later `zfctl resume --max-steps`
        #    continues the same trajectory), then install any in-flight CPU update: the weights
        #    are final.
        if self.saved_step != p.step:
            self.save_checkpoint(p.step)
        opt.flush()
        eval_loss = self._evaluate()
        self._log_eval(p.step, eval_loss)
        self.display.close()
        return RunResult(output_dir=self.run_dir, steps=p.step, final_train_loss=p.last_loss,
                         final_eval_loss=eval_loss, last_checkpoint=self.last_checkpoint)

    def _evaluate(self) -> float | None:
        t = self.plan.train
        return evaluate(self.model, self.data.eval, self.data.collate, self.device,
                        micro_batch_size=t.micro_batch_size, max_batches=t.eval_batches, rank=self.env.rank,
                        world_size=self.env.world_size)

    def _log_eval(self, step: int, eval_loss: float | None) -> None:
        if eval_loss is None:
            return
        if self.metrics is not None:
            self.metrics.log({"kind": "eval", "step": step, "eval_loss": eval_loss})
        self.display.print(format_eval_line(step, eval_loss, self.total_steps))

    def _diverged(self, step: int, loss: float, grad_norm: float | None, lr: float) -> RunFailed:
        """One line: which step, what went non-finite, the likely causes, where to go back to."""
        what = f"loss {loss}" + ("" if grad_norm is None else f", gradient norm {grad_norm}")
        back = (f"the last checkpoint {self.last_checkpoint} is from before it" if self.last_checkpoint
                else "no checkpoint was written yet")
        return RunFailed(f"step {step}: {what}: training diverged and was stopped, no checkpoint was "
                         f"written from this state; likely causes: train.lr={lr:.3g} too high, a bad data "
                         f"record, or a damaged checkpoint it resumed from; {back}")

    # -- save_checkpoint / cleanup --------------------------------------------------------------

    def save_checkpoint(self, step: int) -> Path:
        """Write the exact training state after ``step`` as ``checkpoints/step-XXXXXX``.

        Every rank calls it at the same step (zfctl/train/checkpoint.py: rank 0 writes the shared
        files, each rank its optimizer share and RNG state).
        """
        p = self.progress
        state = {"step": step, "scheduler": self.scheduler.state_dict(),
                 "sampler": self.sampler.position.to_dict(), "num_train_samples": len(self.data.train),
                 "steps_per_epoch": self.steps_per_epoch, "zfctl_version": __version__,
                 "tokens_seen": p.tokens_seen, "last_loss": p.last_loss}
        path = ck.save_checkpoint(
            self.run_dir, step, model=self.model, optimizer_state=self.optimizer.state_dict(),
            trainer_state=state, write_plan=lambda f: dump_plan_yaml(self.plan, f),
            keep_last=self.plan.checkpoint.keep_last, rank=self.env.rank, world_size=self.env.world_size,
            barrier=self._barrier, estimate=self._checkpoint_bytes)
        self.last_checkpoint, self.saved_step = path, step
        self.display.print(f"checkpoint {path}")
        return path

    def cleanup(self) -> None:
        """Close what :meth:`setup` opened, newest first: the console, the metrics sinks, the
        optimizer's CPU worker thread, then the process group and the determinism flag."""
        self._cleanup.close()


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)
