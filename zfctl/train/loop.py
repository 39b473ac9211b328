"""The training loop: one linear function, from the first micro-batch to the final checkpoint.

Everything it needs is built beforehand (``zfctl.train.session``) and handed over in a
:class:`LoopInputs`; this file only trains, evaluates, logs and checkpoints. Per optimizer step:

1. draw ``gradient_accumulation_steps`` micro-batches from the resumable sampler (host only);
2. forward + backward each, the loss normalised by the step's number of target tokens;
3. ``optimizer.step()`` (ZenFlow: device AdamW on the selected columns, the rest to the CPU),
   then the LR scheduler;
4. one ``.item()`` sync for the loss, a metrics record, a console line every N steps;
5. the non-finite guard: a NaN/inf loss or gradient norm stops the run before any checkpoint
   (except under fp16, whose loss scaler skips such steps by design);
6. evaluation / checkpoint when due, or when a stop signal arrived.

At the end: a checkpoint of the exact training state, then ``optimizer.flush()`` (installs an
in-flight CPU update into the weights) and the final evaluation of the finished model.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zfctl.errors import RunFailed
from zfctl.train.checkpoint import CHECKPOINTS, step_name
from zfctl.train.data.sampler import ResumableSampler
from zfctl.train.data.templates import IGNORE_INDEX
from zfctl.train.display import Display, format_eval_line, format_train_line
from zfctl.train.metrics import MetricsWriter, StepTimer, memory_stats
from zfctl.train.optim import TrainingOptimizer
from zfctl.train.signals import StopSignals, interrupted

# Test hook: "RANK:STEP" makes rank RANK raise RunFailed during optimizer step STEP, after its
# backward and before optimizer.step()'s collectives (where its peers then wait), so tests can
# check that one failing rank ends the whole job (tests/test_failures.py).
FAIL_ENV = "ZFCTL_TEST_FAIL_STEP"


@dataclass
class LoopInputs:
    """Everything the loop touches, already built and (on resume) restored."""

    model: torch.nn.Module
    optimizer: TrainingOptimizer  # zfctl/train/optim.py: the seam to the ZenFlow engine
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: ResumableSampler
    train_data: Sequence[dict]
    eval_data: Sequence[dict] | None
    collate: Callable[[list[dict]], dict[str, torch.Tensor]]
    device: torch.device
    start_step: int
    total_steps: int
    grad_accum: int
    micro_batch_size: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    log_every: int
    save_checkpoint: Callable[[int, dict], Path]  # (step, loop counters) -> checkpoint folder
    metrics: MetricsWriter | None  # None on ranks other than 0
    display: Display
    run_dir: Path
    rank: int = 0
    world_size: int = 1
    tokens_seen: int = 0  # restored from the checkpoint: totals continue across resumes
    last_loss: float | None = None  # the checkpoint's last loss (reported if no step is left)
    guard_non_finite: bool = True  # False under fp16: the loss scaler skips overflowing steps itself


@dataclass
class LoopResult:
    steps: int
    final_train_loss: float | None
    final_eval_loss: float | None
    last_checkpoint: Path | None


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the target tokens (labels != -100).

    Position t predicts token t+1. Logits are upcast to fp32 for the softmax: bf16 logits lose
    ~3 significant digits in log-sum-exp over a large vocabulary (costs B*T*V*4 bytes, once).
    """
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _targets(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    # A few KB of token ids per micro-batch cross PCIe here; from unpinned memory the copy is
    # synchronous, which is negligible next to the forward pass.
    return {k: v.to(device) for k, v in batch.items()}


def _all_reduce_sum(values: list[float], device: torch.device, world_size: int) -> list[float]:
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(model: torch.nn.Module, eval_data: Sequence[dict] | None, collate: Callable,
             device: torch.device, *, micro_batch_size: int, max_batches: int, rank: int = 0,
             world_size: int = 1) -> float | None:
    """Mean next-token loss over the first ``max_batches`` micro-batches of ``eval_data``.

    Always the same batches, in order, so evaluations are comparable across steps and runs.
    Ranks take every ``world_size``-th batch; the token-weighted sums are all-reduced once.
    """
    if not eval_data:
        return None
    n_batches = min(max_batches, -(-len(eval_data) // micro_batch_size))
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_tokens = 0
    for b in range(rank, n_batches, world_size):
        lo = b * micro_batch_size
        batch = collate([eval_data[i] for i in range(lo, min(lo + micro_batch_size, len(eval_data)))])
        n_tokens += _targets(batch)
        batch = _to_device(batch, device)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False).logits
        loss_sum += lm_loss_sum(logits, batch["labels"]).double()
    model.train(was_training)
    total, tokens = _all_reduce_sum([float(loss_sum), float(n_tokens)], device, world_size)  # sync
    return total / tokens if tokens else None


def train(x: LoopInputs) -> LoopResult:
    """Run optimizer steps ``x.start_step + 1 .. x.total_steps``; see the module docstring."""
    model, opt = x.model, x.optimizer
    model.train()
    step, loss, eval_loss, last_ckpt = x.start_step, x.last_loss, None, None
    saved_step = x.start_step if x.start_step > 0 else None  # a resumed run starts from a checkpoint
    tokens_seen = x.tokens_seen
    timer = StepTimer(x.device)
    stop = StopSignals(
        on_first=lambda s: x.display.print(
            "[yellow]stop requested: finishing this step and writing a checkpoint "
            "(press Ctrl-C again to abort without one)"),
        abort_message=lambda s: None if x.rank != 0 else "no checkpoint was written; " + (
            f"the newest in {x.run_dir} is step {saved_step} (continue: zfctl resume {x.run_dir})"
            if saved_step else f"{x.run_dir} has none yet"))

    def counters() -> dict[str, Any]:
        return {"tokens_seen": tokens_seen, "last_loss": loss}

    window: list[float] = []  # losses since the last console line: the line shows their mean
    x.display.start(x.total_steps, x.start_step)
    if x.start_step == 0 and x.eval_every > 0:  # the baseline the falling eval loss is read against
        _log_eval(x, 0, evaluate(model, x.eval_data, x.collate, x.device, micro_batch_size=x.micro_batch_size,
                                 max_batches=x.eval_batches, rank=x.rank, world_size=x.world_size))
    with stop:
        while step < x.total_steps:
            t_step = time.perf_counter()
            # -- data: the whole step's micro-batches first, so the loss can be normalised by
            #    the step's total target-token count (each token weighs the same regardless of
            #    how the step is cut into micro-batches). Host-only work, no device sync.
            batches = [x.collate([x.train_data[i] for i in x.sampler.next_indices()])
                       for _ in range(x.grad_accum)]
            n_targets: float = max(1, sum(_targets(b) for b in batches))
            if x.world_size > 1:
                # Divide by the global target count / world_size, not by this rank's: after the
                # optimizer averages gradients over ranks, every token then weighs the same
                # whichever rank saw it (the 1-process loss of the global batch). One tiny
                # all-reduce before the forward; on NCCL it is a host<->device sync as well.
                n_targets = max(1.0, _all_reduce_sum([float(n_targets)], x.device, x.world_size)[0])
                n_targets /= x.world_size
            n_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
            lr = opt.param_groups[0]["lr"]  # the LR this step uses (the scheduler moves it after)

            # -- forward / backward ("device compute"). With several processes the optimizer
            #    averages the gradients over ranks in step() (see n_targets above).
            timer.start()
            step_loss = torch.zeros((), device=x.device)
            for i, batch in enumerate(batches):
                batch = _to_device(batch, x.device)
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               use_cache=False).logits
                micro_loss = lm_loss_sum(logits, batch["labels"]) / n_targets
                # The last backward's gradients are final: they stream to the host during it
                # (zfctl/offload/stream.py), overlapped with the rest of the backward pass.
                opt.prepare_backward(final=i == len(batches) - 1)
                opt.scale_loss(micro_loss).backward()  # x loss scale under fp16, identity otherwise
                step_loss += micro_loss.detach()
                del logits, micro_loss  # free the activations' largest tensor before the next one
            timer.stop()
            _fail_hook(x.rank, step + 1)

            # -- optimizer: ZenFlow updates the selected columns on the device and hands the
            #    rest to its CPU worker; stats say how long it waited for that worker.
            stats = opt.step()
            x.scheduler.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            # The step's one deliberate device->host sync. Distributed, one small all-reduce more
            # (free for one process): the logged loss is the mean over ranks, tokens their sum,
            # and every rank learns of a stop request, so all checkpoint at the same step.
            loss, step_tokens, votes = _all_reduce_sum(
                [float(step_loss), float(n_tokens), float(stop.requested)], x.device, x.world_size)
            loss, step_tokens, stopping = loss / x.world_size, int(step_tokens), votes > 0
            if hasattr(stats, "resolve"):  # StepStats' device timings: read after the sync above, free
                stats.resolve()
            tokens_seen += step_tokens
            step_ms = (time.perf_counter() - t_step) * 1e3

            # -- metrics (rank 0) and the console line every log_every steps.
            if x.metrics is not None:
                rec = {"kind": "train", "step": step, "loss": loss, "lr": lr,
                       "tokens": step_tokens, "tokens_seen": tokens_seen,
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
                       "h2d_bytes": stats.h2d_bytes, "epoch": x.sampler.position.epoch,
                       **memory_stats(x.device)}
                if x.world_size > 1:  # rank 0's data-parallel traffic (gradients, installed columns)
                    rec["comm_bytes"] = getattr(stats, "comm_bytes", 0)
                x.metrics.log(rec)
                window.append(loss)
                if step % x.log_every == 0 or step == x.start_step + 1 or step == x.total_steps:
                    x.display.print(format_train_line({**rec, "loss": sum(window) / len(window),
                                                       "loss_steps": len(window)}, x.total_steps))
                    window.clear()
            x.display.advance(step, loss)

            # -- non-finite guard: the step's update already used the NaN/inf gradient, so this
            #    state must never become a checkpoint (nor push a good one out of keep_last).
            #    Every rank sees the same all-reduced loss and the same averaged-gradient norm.
            if x.guard_non_finite and not (math.isfinite(loss) and _finite(stats.grad_norm)):
                x.display.close()
                raise _diverged(x, step, loss, stats.grad_norm, lr, saved_step)

            # -- evaluation (the last step's is done after flush, on the finished model).
            if x.eval_every > 0 and step % x.eval_every == 0 and step < x.total_steps:
                eval_loss = evaluate(model, x.eval_data, x.collate, x.device,
                                     micro_batch_size=x.micro_batch_size, max_batches=x.eval_batches,
                                     rank=x.rank, world_size=x.world_size)
                _log_eval(x, step, eval_loss)

            # -- checkpoint when due, or when a stop was requested (on any rank, see above).
            due = x.checkpoint_every > 0 and step % x.checkpoint_every == 0 and step < x.total_steps
            if due or stopping:
                last_ckpt = x.save_checkpoint(step, counters())
                saved_step = step
                x.display.print(f"checkpoint {last_ckpt}")
            if stopping:
                exc = interrupted(stop.signum or 15, step, str(x.run_dir))
                x.display.print(f"[yellow]{exc.message}")
                x.display.close()
                raise exc

    # -- end: save the exact training state first (a later `zfctl resume --max-steps` continues
    #    the same trajectory), then install any in-flight CPU update: the weights are final.
    if saved_step != step:
        last_ckpt = x.save_checkpoint(step, counters())
        x.display.print(f"checkpoint {last_ckpt}")
    opt.flush()
    eval_loss = evaluate(model, x.eval_data, x.collate, x.device, micro_batch_size=x.micro_batch_size,
                         max_batches=x.eval_batches, rank=x.rank, world_size=x.world_size)
    _log_eval(x, step, eval_loss)
    x.display.close()
    return LoopResult(steps=step, final_train_loss=loss, final_eval_loss=eval_loss,
                      last_checkpoint=last_ckpt)


def _fail_hook(rank: int, step: int) -> None:
    spec = os.environ.get(FAIL_ENV)
    if spec and spec.split(":") == [str(rank), str(step)]:
        raise RunFailed(f"step {step}: failure injected by {FAIL_ENV}={spec} (a test hook)")


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def _diverged(x: LoopInputs, step: int, loss: float, grad_norm: float | None, lr: float,
              saved_step: int | None) -> RunFailed:
    """One line: which step, what went non-finite, the likely causes, where to go back to."""
    what = f"loss {loss}" + ("" if grad_norm is None else f", gradient norm {grad_norm}")
    back = (f"the last checkpoint {x.run_dir / CHECKPOINTS / step_name(saved_step)} is from before it"
            if saved_step else "no checkpoint was written yet")
    return RunFailed(f"step {step}: {what}: training diverged and was stopped, no checkpoint was written "
                     f"from this state; likely causes: train.lr={lr:.3g} too high, a bad data record, or "
                     f"a damaged checkpoint it resumed from; {back}")


def _log_eval(x: LoopInputs, step: int, eval_loss: float | None) -> None:
    if eval_loss is None:
        return
    if x.metrics is not None:
        x.metrics.log({"kind": "eval", "step": step, "eval_loss": eval_loss})
    x.display.print(format_eval_line(step, eval_loss, x.total_steps))
