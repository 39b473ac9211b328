"""The optimizer seam: what the training side needs from an optimizer, and the one that provides it.

:class:`TrainingOptimizer` is the whole contract between ``zfctl/train`` and the ZenFlow engine
in ``zfctl/offload``: the loop, the checkpoints and the run lifecycle use nothing else. mypy
(``make lint``) checks that ``ZenFlowOptimizer`` satisfies it where ``FinetuneRecipe.setup``
(zfctl/train/recipe.py) stores it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from zfctl.plan.schema import RunPlan

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from zfctl.offload import StepStats, ZenFlowOptimizer


class TrainingOptimizer(Protocol):
    """What the loop and the checkpoints call on an optimizer (``ZenFlowOptimizer`` is one)."""

    param_groups: list[dict[str, Any]]  # the LR scheduler writes ``lr`` here; the loop logs it

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (identity in bf16/fp32); call ``backward`` on this."""
        ...

    def prepare_backward(self, *, final: bool) -> None:
        """Say whether the next backward is the last of the step's micro-batches: its gradients
        are final, so they stream to the host during that backward (zfctl/offload/grads/stream.py)."""
        ...

    def attach_install_waits(self, model: torch.nn.Module) -> int:
        """Let each of ``model``'s layers wait (on the device) only for its own part of an install
        of the CPU update, not for the whole install (zfctl/offload/device/install.py); how many modules
        were hooked (0 where an install is waited for whole: FSDP2, zero2)."""
        ...

    def step(self) -> StepStats:
        """One optimizer step over the accumulated gradients; what it cost and did."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def flush(self) -> None:
        """Wait for an in-flight CPU update and install it: the weights are final after this."""
        ...

    def close(self) -> None:
        """Stop the CPU worker thread; the optimizer is unusable afterwards."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically (this rank's share of the host state)."""
        ...

    def checkpoint_state(self) -> dict[str, Any]:
        """``state_dict()`` to be written at once: the unfinished interval's gradient sum is formed
        chunk by chunk as the checkpoint writer reads it (no buffer of it in memory)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state_dict; its host pieces may come from any world size (they must cover
        ``host_ranges()``)."""
        ...

    def host_ranges(self) -> list[tuple[str, int, int]]:
        """(parameter name, c0, c1) of the host column ranges this rank holds: which pieces of a
        saved state a resume on another world size must read (zfctl/train/world_size.py)."""
        ...


def build_optimizer(model: torch.nn.Module, plan: RunPlan, *, steps_per_epoch: int,
                    process_group: ProcessGroup | None = None,
                    shard_group: ProcessGroup | None = None,
                    params: list[tuple[str, torch.Tensor]] | None = None) -> ZenFlowOptimizer:
    """A ``ZenFlowOptimizer`` configured from ``plan.train`` and ``plan.zenflow``.

    Every zenflow preset goes through the same optimizer: ``zero-offload`` is ``topk_ratio 0,
    update_interval 1, overlap off`` (plain CPU offload) and ``off`` keeps everything on the
    device (``topk_ratio 1``), so one code path serves all of them and the loop never branches.
    Parameters are passed with their names (they appear in errors and in the state_dict);
    ``named_parameters`` yields a tied weight once. Frozen parameters are left out. The token-indexed
    matrices are named as ``vocab_params``; ``zenflow.vocab_select`` decides what that changes.
    ``shard_group``: the model is FSDP2-sharded over it (zfctl/train/fsdp.py); the optimizer steps
    the local shards (zfctl/offload/parallel/sharded.py). ``params``: the (name, tensor) pairs to step
    instead of ``model``'s trainable parameters, under the same names (export installs one FSDP2
    rank's update on copies of that rank's rows, zfctl/train/weights.py).
    """
    from zfctl.offload import ZenFlowOptimizer, vocab_matrices

    t = plan.train
    if params is None:
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # The plan's answers, never this machine's: a plan made for a 5 GB card builds the host path
    # on a 141 GB one (zfctl/plan/settle.py). Only a plan that still says auto (a library plan, one
    # whose model size was unknown before loading) is settled, here, once, for the plan's machine.
    zen = settle_for_model(plan, model).zenflow
    return ZenFlowOptimizer(
        params, zen, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, loss_scaling=None, steps_per_epoch=steps_per_epoch,
        process_group=process_group, vocab_params=vocab_matrices(model), shard_group=shard_group,
    )


def settle_for_model(plan: RunPlan, model: torch.nn.Module) -> RunPlan:
    """``plan`` with every ``auto`` settled (zfctl/plan/settle.py); ``plan`` itself when nothing is
    left to settle (every plan `zfctl plan`/`finetune`/`resume` made). A plan that cannot size its
    model (a hub id with neither ``model.config`` nor ``model.params_b``) is settled with the
    built ``model``'s shapes, so its answers are the ones its memory lines would have given."""
    from zfctl.plan.settle import settle, unsettled

    if not unsettled(plan):
        return plan
    from zfctl.plan.sizes import size_of_model

    m = plan.model
    knows = bool(m.source == "config" and m.config) or bool(m.params_b)
    return settle(plan, size=None if knows else size_of_model(model))
