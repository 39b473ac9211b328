"""One training run, as an object with a lifecycle named after torchtune's recipe interface.

``zfctl.train.session``'s ``run`` and ``resume`` drive it the same way and differ only in the
checkpoint they give ``load_checkpoint`` (None: a fresh run)::

    with FinetuneRecipe(plan, data, env, lock=lock) as recipe:  # cleanup() on the way out
        recipe.load_checkpoint(ckpt)  # refuses what it cannot continue before anything is built
        recipe.setup()  # the parts, the checkpoint's state in them, then the output folder
        result = recipe.train()  # the loop; calls save_checkpoint(step) when one is due

``load_checkpoint`` comes first, as in torchtune: a refusal comes before the process group forms,
so torchrun peers are never left waiting in a collective. ``cleanup`` closes what ``setup``
opened, newest first, however far it got.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
from rich.console import Console
from typing_extensions import Self

from zfctl.errors import ConfigError
from zfctl.plan.fit import resolve_activation_checkpointing
from zfctl.plan.io import dump_plan_yaml
from zfctl.plan.schema import RunPlan
from zfctl.plan.validate import check_max_length, check_packing
from zfctl.quiet import is_verbose
from zfctl.train import checkpoint as ck
from zfctl.train.data.sampler import ResumableSampler
from zfctl.train.display import Display, NullDisplay, RichDisplay, format_eval_line, note_line
from zfctl.train.dist import DistEnv, process_setup, train_device
from zfctl.train.fsdp import resolve_strategy
from zfctl.train.lock import FolderLock
from zfctl.train.loss import all_reduce_sum, evaluate, forward_backward, loss_divisor, non_finite
from zfctl.train.metrics import MetricsWriter, StepTimer, open_metrics, train_record
from zfctl.train.models.load import enable_activation_checkpointing, load_model
from zfctl.train.optim import TrainingOptimizer, build_optimizer, settle_for_model
from zfctl.train.progress import Progress, Restore, RunResult, StepResult, read_trainer_state, trainer_state
from zfctl.train.rundir import RunFolder
from zfctl.train.schedule import Cadence, build_scheduler
from zfctl.train.signals import StopSignals, interrupted, run_stop_signals
from zfctl.train.testhooks import fail_or_hang, slow_teardown

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.optim.lr_scheduler import LambdaLR

    from zfctl.train.data.prepare import PreparedData
    from zfctl.train.samples import SamplePrompts


class FinetuneRecipe:
    """Fine-tuning ``plan`` on ``data`` in this process (one rank of ``env``).

    The parts below are built by :meth:`setup`; reading one before that is a bug. ``progress``,
    ``resumed_from`` and ``last_checkpoint`` are set by :meth:`load_checkpoint` and kept current
    by :meth:`train` and :meth:`save_checkpoint`. ``lock``: the run folder's lock (the caller may
    have taken it, and releases it). ``force``: a fresh run may replace an old run folder's contents.
    ``allow_changes``: a resume may continue on training data whose content changed.
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
                 force: bool = False, allow_changes: bool = False) -> None:
        self.plan, self.data, self.env = plan, data, env
        self.device = train_device(plan, env)
        self.strategy = resolve_strategy(plan, env.world_size)  # zero2 or fsdp (auto resolved; one process: zero2)
        self.run_dir = Path(plan.checkpoint.output_dir)
        self.lock = lock if lock is not None else FolderLock()
        self.force = force
        self.allow_changes = allow_changes  # resume: continue on training data that changed (load_checkpoint)
        self.progress = Progress()
        self.resumed_from: ck.CheckpointInfo | None = None
        self.last_checkpoint: Path | None = None  # the newest checkpoint of this run's state
        self.saved_step: int | None = None  # its step
        self.saved_from: int | None = None  # a resume: the step of the checkpoint it continues
        self._restore: Restore | None = None
        self.samples: SamplePrompts | None = None  # train.sample_prompts (setup)
        self.shard: tuple[int, int] | None = None  # fsdp: (rank, size) in the shard group (_build_model)
        self._checkpoint_bytes = 0  # expected size of a checkpoint before the first is written
        self._cleanup = contextlib.ExitStack()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            slow_teardown()  # tests only: zfctl/train/testhooks.py
        self.cleanup()

    def load_checkpoint(self, ckpt: ck.CheckpointInfo | None) -> None:
        """Read what training continues from: nothing (a fresh run: step 0, the plan's seed), or
        ``ckpt`` (its files verified by the caller); refuse changed training data (progress.py).

        A world size other than the checkpoint's was fitted into the plan already (session.py,
        world_size.py); :meth:`setup` re-cuts the optimizer state once the built optimizer knows
        this rank's columns, and puts the rest of the state into the parts as it builds them.
        """
        if ckpt is None:
            return
        self.progress, self._restore = read_trainer_state(
            ckpt, rank=self.env.rank, num_train_samples=len(self.data.train),
            train_digest=lambda: self.data.train_digest, allow_changes=self.allow_changes,
            note=note_line if self.env.rank == 0 else lambda line: None)
        self.resumed_from, self.last_checkpoint, self.saved_step = ckpt, ckpt.path, ckpt.step
        self.saved_from = ckpt.step  # metrics.jsonl keeps the records up to here (_open_run_files)

    def setup(self) -> None:
        """Seeds and the process group, then model, sampler, optimizer and LR scheduler, each with
        the checkpoint's state when resuming; last, the output folder, metrics and console."""
        plan, t, env, restore = self.plan, self.plan.train, self.env, self._restore
        self._cleanup.enter_context(process_setup(plan, env, self.device))
        shard_group = self._build_model(restore.checkpoint if restore is not None else None)
        try:
            self.sampler = ResumableSampler(len(self.data.train), t.micro_batch_size, seed=t.seed, rank=env.rank,
                                            world_size=env.world_size,
                                            position=restore.sampler if restore is not None else None)
        except ValueError as e:  # the data cannot fill one global micro-batch (a file too large to count before)
            raise ConfigError("train.micro_batch_size", t.micro_batch_size, f"{e}; lower it") from None
        self.steps_per_epoch = max(1, self.sampler.batches_per_epoch() // t.gradient_accumulation_steps)
        self.total_steps = (int(t.max_steps) if t.max_steps is not None else
                            max(1, t.epochs * self.sampler.batches_per_epoch() // t.gradient_accumulation_steps))
        # zero2: the optimizer averages the gradients over the world in step(); fsdp: FSDP2's
        # reduce-scatter did, and the optimizer steps the local shards (zfctl/offload/parallel/sharded.py).
        zero2_group = dist.group.WORLD if env.world_size > 1 and shard_group is None else None
        # A plan that could not size its model (a hub id alone) still says auto: settled once, with
        # the built model's shapes, and saved so (zfctl/train/optim.py); any other plan is as made.
        self.plan = plan = settle_for_model(plan, self.model)
        self.optimizer = build_optimizer(self.model, plan, steps_per_epoch=self.steps_per_epoch,
                                         process_group=zero2_group, shard_group=shard_group)
        self._cleanup.callback(self.optimizer.close)  # its CPU worker thread runs from here on
        # An install of the CPU update runs on its own stream; each layer's forward waits only for
        # its own columns (zfctl/offload/device/install.py), so the first layers compute while the last land.
        self.optimizer.attach_install_waits(self.model)
        self.scheduler = build_scheduler(self.optimizer, t.schedule, warmup_steps=t.warmup_steps,
                                         total_steps=self.total_steps)
        if t.sample_prompts:  # zfctl/train/samples.py: answered at each evaluation
            from zfctl.train.samples import SamplePrompts

            self.samples = SamplePrompts(plan, model_config=getattr(self.model, "config", None))
        if restore is not None:
            # fsdp: the rows of this rank's place in the shard group (HSDP: within its node)
            rank, world = self.shard if self.shard is not None else (env.rank, env.world_size)
            restore.install(self.optimizer, self.scheduler, rank=rank, world_size=world, strategy=self.strategy,
                            note=note_line)
            self._restore = None  # installed: its sampler, scheduler and RNG state are not needed any more
        self._claim_run_folder()

    def _build_model(self, ckpt: ck.CheckpointInfo | None) -> ProcessGroup | None:
        """The model, with ``ckpt``'s weights and activation checkpointing as the plan says; under
        fsdp sharded with FSDP2 and the group it is sharded over returned (None: zero2).

        fsdp, the torchtitan order: each rank builds the whole model on the host, activation
        checkpointing wraps its layers, then ``parallelize`` shards it layer by layer (moving each
        shard to the device, so the device never holds the whole model); the ranks of a node
        take turns (zfctl/train/fsdp.py ``load_in_turns``), so the node's host peak is one whole
        model. A checkpoint's weights are then read into the shards, each rank its own rows
        (zfctl/train/checkpoint/shards.py), whatever layout they were saved in."""
        plan, t, env = self.plan, self.plan.train, self.env
        ac = resolve_activation_checkpointing(plan)  # a plan made by zfctl says true/false; a library one may say auto

        def build(device: torch.device) -> torch.nn.Module:
            model = load_model(plan.model, precision=t.precision, device=device, seed=t.seed)
            check_max_length(plan.data.max_length, getattr(model, "config", None))  # hub/local models
            check_packing(plan.data.packing, getattr(model, "config", None))
            return model

        if self.strategy != "fsdp":
            self.model = build(self.device)
            if ckpt is not None:
                ck.load_model_weights(ckpt, self.model)
            if ac:
                enable_activation_checkpointing(self.model)  # zfctl/train/models/load.py: per layer, non-reentrant
            return None
        from zfctl.offload import vocab_matrices
        from zfctl.train.fsdp import (
            check_shardable,
            data_parallel_mesh,
            hsdp_replicas,
            load_in_turns,
            parallelize,
        )

        # A 1-D mesh over every rank, or with distributed.hsdp HSDP's (replicate, shard) mesh: rows
        # sharded within a node, replicated across nodes (docs/design.md, "ZenFlow on FSDP2 shards").
        mesh = data_parallel_mesh(self.device.type, env.world_size,
                                  replicas=hsdp_replicas(plan, env.world_size, env.local_world_size))
        group = mesh.get_group("shard")
        self.shard = place = (dist.get_rank(group), dist.get_world_size(group))

        def shard() -> torch.nn.Module:
            model = build(torch.device("cpu"))  # fully_shard moves each shard to the mesh's device
            by_row = vocab_matrices(model) if plan.zenflow.vocab_select == "rows" else []
            check_shardable(model, place[1], by_row)  # HSDP: the shard group's size
            if ac:
                enable_activation_checkpointing(model)
            return parallelize(model, mesh, by_row=by_row)

        self.model = load_in_turns(env.local_rank, env.local_world_size, self.device, shard)
        if ckpt is not None:
            ck.load_model_weights(ckpt, self.model)
        return group

    def _claim_run_folder(self) -> None:
        """Every input is good: only now touch the output folder (rank 0 writes, all wait).

        A fresh run writes ``plan.yaml`` and opens ``metrics.jsonl`` here. A resume only locks the
        folder and checks its disk here: its ``plan.yaml`` and ``metrics.jsonl`` (the records
        after the checkpoint dropped) are rewritten once its first step has trained
        (:meth:`_open_run_files`), so a resume that fails before that leaves every file of the
        run folder as it was (each is replaced atomically when it is)."""
        fresh, main = self.resumed_from is None, self.env.rank == 0
        self._checkpoint_bytes = ck.estimate_bytes(self.model)
        self.metrics = None
        if main:
            RunFolder(self.run_dir, fresh=fresh, force=self.force).claim(self.lock, estimate=self._checkpoint_bytes)
            if fresh:
                self._open_run_files()
        self._barrier()
        # The step line's legend once per run folder: above a fresh run's first line, not a
        # resume's (--verbose: every time).
        self.display = RichDisplay(Console(), legend=fresh or is_verbose()) if main else NullDisplay()
        self._cleanup.callback(self.display.close)

    def _open_run_files(self) -> None:
        """Rank 0: ``plan.yaml`` (atomic) and ``metrics.jsonl`` with its sinks (:meth:`_claim_run_folder`)."""
        dump_plan_yaml(self.plan, self.run_dir / ck.PLAN_FILE)
        self.metrics = open_metrics(self.plan, self.run_dir, resume_step=self.saved_from, note=note_line)
        self._cleanup.callback(self.metrics.close)

    def _barrier(self) -> None:
        if self.env.world_size > 1:
            dist.barrier()

    def train(self) -> RunResult:
        """Optimizer steps ``progress.step + 1 .. total_steps``, top to bottom. Per step:
        :meth:`_train_step`; a metrics record and the console (rank 0); the non-finite guard (a
        NaN/inf loss or gradient norm stops the run before any checkpoint, except under fp16,
        whose loss scaler skips such steps by design); evaluation and checkpoint when due, or
        when a stop signal arrived (one that arrives during them ends the run after them). At the end: a checkpoint of the exact training state, then
        ``optimizer.flush()`` (installs an in-flight CPU update) and the final evaluation.
        """
        p, total, start = self.progress, self.total_steps, self.progress.step
        when = Cadence.of(self.plan, start=start, total=total)
        guard_non_finite = self.plan.train.precision != "fp16"  # fp16's loss scaler skips overflows itself
        self.model.train()
        timer = StepTimer(self.device)
        # A second signal removes the partial folder of a save in progress when this process is
        # its only writer; under --nproc the other ranks may still be writing into it (a line names it).
        stop = run_stop_signals(self.display.print, rank=self.env.rank, run_dir=self.run_dir,
                                newest=lambda: self.saved_step, world_size=self.env.world_size,
                                abandon=lambda: ck.abandon_save(remove=self.env.world_size == 1))
        self.display.start(total, start)
        if start == 0 and when.eval_every > 0:  # the baseline the falling eval loss is read against
            self._evaluate(0)
        with stop:
            while p.step < total:
                s = self._train_step(timer, stop)
                step = p.step
                if self.env.rank == 0 and self.metrics is None:  # a resume's first step trained: now its files
                    self._open_run_files()
                if self.metrics is not None:  # rank 0: metrics.jsonl, the progress bar and console line
                    rec = train_record(step, s, tokens_seen=p.tokens_seen, compute_ms=timer.ms(),
                                       epoch=self.sampler.position.epoch, device=self.device,
                                       world_size=self.env.world_size)
                    self.metrics.log(rec)
                    self.display.step(rec, line=when.should_log(step))
                # The step's update already used the NaN/inf gradient, so this state must never
                # become a checkpoint (nor push a good one out of keep_last). Every rank sees the
                # same all-reduced loss and the same averaged-gradient norm.
                if guard_non_finite and (failed := non_finite(step, s.loss, s.stats.grad_norm, s.lr,
                                                              self.last_checkpoint)):
                    self.display.close()
                    raise failed
                if when.should_eval(step):
                    self._evaluate(step)
                saving = when.should_save(step) or s.stopping  # a stop on any rank: all save this step
                if saving:
                    self.save_checkpoint(step)
                # A stop that came during this evaluation or save (after the step's vote) ends the
                # run here too: the save just written is the stop checkpoint, or one is written now.
                if s.stopping or ((saving or when.should_eval(step)) and stop.voted(self.device, self.env.world_size)):
                    if not saving:
                        self.save_checkpoint(step)
                    self._stop(stop, step)

            # -- end: save the exact training state first (a later `zfctl resume --max-steps`
            #    continues the same trajectory), then install any in-flight CPU update: the weights
            #    are final. A stop during this save finishes it and ends the run without the final
            #    evaluation.
            if self.saved_step != p.step:
                self.save_checkpoint(p.step)
                if stop.voted(self.device, self.env.world_size):
                    self._stop(stop, p.step)
        self.optimizer.flush()
        eval_loss = self._evaluate(p.step)
        self.display.close()
        return RunResult(output_dir=self.run_dir, steps=p.step, final_train_loss=p.last_loss,
                         final_eval_loss=eval_loss, last_checkpoint=self.last_checkpoint)

    def _stop(self, stop: StopSignals, step: int) -> NoReturn:
        """End the run after ``step``, whose checkpoint is saved, with the signal's exit code."""
        exc = interrupted(stop.signum or 15, step, str(self.run_dir))
        self.display.print(f"[yellow]{exc.message}")
        self.display.close()
        raise exc

    def _train_step(self, timer: StepTimer, stop: StopSignals) -> StepResult:
        """One optimizer step on every rank: the micro-batches, forward + backward, the optimizer
        and LR scheduler, and the step's one device->host sync. Advances :attr:`progress`."""
        model, opt, data, p, device = self.model, self.optimizer, self.data, self.progress, self.device
        world_size = self.env.world_size
        t_step = time.perf_counter()
        # -- data: the whole step's micro-batches first, so the loss can be normalised by the
        #    step's total target-token count. Host-only work, no device sync (one process).
        batches = [data.collate([data.train[i] for i in self.sampler.next_indices()])
                   for _ in range(self.plan.train.gradient_accumulation_steps)]
        n_targets = loss_divisor(batches, device, world_size)  # distributed: one tiny all-reduce
        n_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        lr = opt.param_groups[0]["lr"]  # the LR this step uses (the scheduler moves it after)

        # -- forward / backward ("device compute"). With several processes the optimizer averages
        #    the gradients over ranks in step() (see loss_divisor).
        timer.start()
        step_loss = forward_backward(model, opt, batches, n_targets, device)
        timer.stop()
        fail_or_hang(self.env.rank, p.step + 1)  # tests only: zfctl/train/testhooks.py

        # -- optimizer: ZenFlow updates the selected columns on the device and hands the rest to
        #    its CPU worker; stats say how long it waited for that worker.
        stats = opt.step()
        self.scheduler.step()
        opt.zero_grad(set_to_none=True)
        p.step += 1
        # The step's one deliberate device->host sync. Distributed, one small all-reduce more
        # (free for one process): the logged loss is the mean over ranks, tokens their sum, and
        # every rank learns of a stop request, so all checkpoint at the same step.
        loss, step_tokens, votes = all_reduce_sum(
            [float(step_loss), float(n_tokens), float(stop.requested)], device, world_size)
        loss, tokens = loss / world_size, int(step_tokens)
        if hasattr(stats, "resolve"):  # StepStats' device timings: read after the sync above, free
            stats.resolve()
        p.last_loss = loss
        p.tokens_seen += tokens
        return StepResult(loss=loss, lr=lr, tokens=tokens, step_ms=(time.perf_counter() - t_step) * 1e3,
                          stats=stats, stopping=votes > 0)

    def _evaluate(self, step: int) -> float | None:
        """The eval loss of the model as it is after ``step``, logged (None: no eval data)."""
        t = self.plan.train
        eval_loss = evaluate(self.model, self.data.eval, self.data.collate, self.device,
                             micro_batch_size=t.micro_batch_size, max_batches=t.eval_batches,
                             rank=self.env.rank, world_size=self.env.world_size,
                             lockstep=self.strategy == "fsdp")
        if eval_loss is not None:
            if self.metrics is not None:
                self.metrics.log({"kind": "eval", "step": step, "eval_loss": eval_loss})
            self.display.print(format_eval_line(step, eval_loss, self.total_steps))
        if self.samples is not None:  # the answers to train.sample_prompts, printed and logged
            self.samples.show(step, self.total_steps, self.model, self.device, rank=self.env.rank,
                              lockstep=self.strategy == "fsdp" and self.env.world_size > 1, say=self.display.print,
                              log=None if self.metrics is None else partial(self.metrics.log, sinks=False))
        return eval_loss

    def save_checkpoint(self, step: int) -> Path:
        """Write the exact training state after ``step`` (= ``progress.step``) as
        ``checkpoints/step-XXXXXX``. Every rank calls it at the same step (zfctl/train/checkpoint/
        write.py: rank 0 writes the shared files, each rank its optimizer share and RNG state)."""
        state = trainer_state(self.progress, scheduler=self.scheduler.state_dict(),
                              sampler=self.sampler.position, num_train_samples=len(self.data.train),
                              steps_per_epoch=self.steps_per_epoch, train_digest=self.data.train_digest)
        path = ck.save_checkpoint(
            self.run_dir, step, model=self.model, optimizer_state=self.optimizer.checkpoint_state(),
            trainer_state=state, write_plan=lambda f: dump_plan_yaml(self.plan, f),
            keep_last=self.plan.checkpoint.keep_last, rank=self.env.rank, world_size=self.env.world_size,
            barrier=self._barrier, estimate=self._checkpoint_bytes, previous=self.last_checkpoint,
            strategy=self.strategy, shard=self.shard)
        self.last_checkpoint, self.saved_step = path, step
        self.display.print(f"checkpoint {path}")
        return path

    def cleanup(self) -> None:
        """Close what :meth:`setup` opened, newest first: the console, the metrics sinks, the
        optimizer's CPU worker thread, then the process group and the determinism flag."""
        self._cleanup.close()
