"""The training loss and what it takes across processes: next-token loss, evaluation, sums, and
the verdict on a loss that is not finite.

Used by the loop (:meth:`zfctl.train.recipe.FinetuneRecipe.train`) and its tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zfctl.errors import RunFailed
from zfctl.train.data.templates import IGNORE_INDEX

if TYPE_CHECKING:
    from zfctl.train.optim import TrainingOptimizer


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the target tokens (labels != -100).

    Position t predicts token t+1. Logits are upcast to fp32 for the softmax: bf16 logits lose
    ~3 significant digits in log-sum-exp over a large vocabulary (costs B*T*V*4 bytes, once).
    """
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The forward's tensor arguments for ``batch``.

    A packed batch (it holds ``position_ids``, restarting at each sequence) goes in with its
    positions and *no* attention mask: transformers then builds the attention from the positions
    (masking_utils' ``find_packed_sequence_indices``), a block-diagonal causal mask for sdpa and
    eager attention and per-sequence (varlen) kernels for flash attention, so no token attends
    across a sequence boundary (tests/train/test_chat_packing.py: same per-token loss as unpacked). Its
    right padding needs no mask either: under the causal mask no real token sees a later pad.
    """
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def targets(batch: dict[str, torch.Tensor]) -> int:
    """How many tokens of ``batch`` carry a loss (what :func:`lm_loss_sum` sums over)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def loss_divisor(batches: Sequence[dict[str, torch.Tensor]], device: torch.device, world_size: int) -> float:
    """What each micro-batch's summed loss is divided by: the step's target tokens.

    The whole step's count, so each token weighs the same regardless of how the step is cut into
    micro-batches. With several processes, the global count / world_size, not this rank's: after
    the optimizer averages gradients over ranks, every token then weighs the same whichever rank
    saw it (the 1-process loss of the global batch); one tiny all-reduce before the forward, on
    NCCL a host<->device sync as well.
    """
    n_targets: float = max(1, sum(targets(b) for b in batches))
    if world_size > 1:
        n_targets = max(1.0, all_reduce_sum([float(n_targets)], device, world_size)[0])
        n_targets /= world_size
    return n_targets


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch's tensors on ``device``; on CUDA page-locked first, then copied
    asynchronously, so the copy does not wait for the device to drain.

    A blocking ``.to(device)`` from pageable memory is a stream sync: with gradient accumulation
    the device would drain before every micro-batch after the first (the host waits for the
    previous backward before it can enqueue the next forward). Page-locking the collated batch
    (a host copy of a few KB of token ids into the caching host allocator, which keeps the block
    until the copy's event has fired) makes the PCIe H2D an ordered DMA on the compute stream:
    the forward that reads it runs after it, the host runs ahead. The callers read the batch on
    the host (``targets``) before this, never after.
    """
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def forward_backward(model: torch.nn.Module, opt: TrainingOptimizer, batches: Sequence[dict[str, torch.Tensor]],
                     n_targets: float, device: torch.device) -> torch.Tensor:
    """Forward and backward of one optimizer step's micro-batches; their loss sum (device, no sync).

    ``n_targets``: the step's target-token count (:func:`loss_divisor`), so the gradients are the
    step's mean however the step is split. The last backward's gradients are final: the optimizer
    streams them to the host during it (zfctl/offload/grads/stream.py), overlapped with the rest of
    the backward pass."""
    step_loss = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        batch = to_device(batch, device)
        logits = model(**model_inputs(batch), use_cache=False).logits
        micro_loss = lm_loss_sum(logits, batch["labels"]) / n_targets
        opt.prepare_backward(final=i == len(batches) - 1)
        opt.scale_loss(micro_loss).backward()  # x loss scale under fp16, identity otherwise
        step_loss += micro_loss.detach()
        del logits, micro_loss  # free the activations' largest tensor before the next one
    return step_loss


def all_reduce_sum(values: list[float], device: torch.device, world_size: int) -> list[float]:
    """``values`` summed over ranks in one float64 all-reduce (returned as is for one process)."""
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(model: torch.nn.Module, eval_data: Sequence[dict] | None, collate: Callable,
             device: torch.device, *, micro_batch_size: int, max_batches: int, rank: int = 0,
             world_size: int = 1, lockstep: bool = False) -> float | None:
    """Mean next-token loss over the first ``max_batches`` micro-batches of ``eval_data``.

    Always the same batches, in order, so evaluations are comparable across steps and runs.
    Ranks take every ``world_size``-th batch; the token-weighted sums are all-reduced once.
    ``lockstep`` (an FSDP2 model, whose forward all-gathers each layer: a collective): every rank
    runs the same number of forwards, a rank left without a batch in the last round running its
    first batch again and counting nothing of it.
    """
    if not eval_data:
        return None
    n_batches = min(max_batches, -(-len(eval_data) // micro_batch_size))
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_tokens = 0
    rounds = -(-n_batches // world_size) if lockstep else len(range(rank, n_batches, world_size))
    for j in range(rounds):
        b = rank + j * world_size
        counted = b < n_batches
        lo = (b if counted else 0) * micro_batch_size
        batch = collate([eval_data[i] for i in range(lo, min(lo + micro_batch_size, len(eval_data)))])
        n_tokens += targets(batch) if counted else 0
        batch = to_device(batch, device)
        logits = model(**model_inputs(batch), use_cache=False).logits
        if counted:
            loss_sum += lm_loss_sum(logits, batch["labels"]).double()
    model.train(was_training)
    total, tokens = all_reduce_sum([float(loss_sum), float(n_tokens)], device, world_size)  # sync
    return total / tokens if tokens else None


def non_finite(step: int, loss: float, grad_norm: float | None, lr: float,
               last_checkpoint: Path | None) -> RunFailed | None:
    """None when the step's loss and gradient norm (None: not measured) are finite; else the one
    line that stops the run: which step, what went non-finite, the likely causes, where to go back to."""
    if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
        return None
    what = f"loss {loss}" + ("" if grad_norm is None else f", gradient norm {grad_norm}")
    back = (f"the last checkpoint {last_checkpoint} is from before it" if last_checkpoint
            else "no checkpoint was written yet")
    return RunFailed(f"step {step}: {what}: training diverged and was stopped, no checkpoint was "
                     f"written from this state; likely causes: train.lr={lr:.3g} too high, a bad data "
                     f"record, or a damaged checkpoint it resumed from; {back}")
