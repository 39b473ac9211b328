"""``train.sample_prompts``: the model's answers to a few fixed prompts at each evaluation, printed
and logged (``kind: sample`` records in metrics.jsonl), so a user sees the fine-tune work.

Each prompt is rendered in the run's prompt format, as ``zfctl generate`` renders it
(zfctl/train/data/prompt_format.py), and answered greedily with the live model, at most
:data:`SAMPLE_TOKENS` new tokens. Greedy decoding draws nothing from any RNG, so sampling leaves
the run's losses bit-identical. Cost: one forward over the whole sequence per new token (no KV
cache, the model is the training one), and one device->host sync per token to read it.

Under zero2 (and one process) rank 0 alone answers: every rank holds the whole model, and the
others wait at the next step's first collective. Under fsdp every forward all-gathers each layer,
a collective, so every rank decodes in lockstep: rank 0's token is broadcast each step, and all
ranks stop together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from rich.markup import escape

from zfctl.errors import UserError
from zfctl.plan.schema import RunPlan

SAMPLE_TOKENS = 48  # new tokens per answer: a short answer, a few seconds of a 7B model's forwards


class SamplePrompts:
    """The run's ``train.sample_prompts``, tokenised once in its prompt format."""

    def __init__(self, plan: RunPlan, *, model_config: object) -> None:
        """A UserError (one line) for a prompt that leaves the model no position to answer in,
        as ``zfctl generate`` refuses one: never cut to its end."""
        from zfctl.plan.validate import position_limit
        from zfctl.train.data.prompt_format import prompt_template
        from zfctl.train.generate import hf_errors_only
        from zfctl.train.models.load import load_tokenizer

        found = position_limit(model_config) if model_config is not None else None
        model_limit = None if found is None else found[1]

        self.tokenizer: Any = load_tokenizer(plan.model)
        self.tokenizer.chat_template = prompt_template(plan.data, self.tokenizer)
        self.prompts = list(plan.train.sample_prompts or [])
        limit = model_limit or plan.data.max_length + SAMPLE_TOKENS
        self.ids: list[list[int]] = []
        for i, text in enumerate(self.prompts):
            with hf_errors_only():  # transformers' raw "Token indices sequence length" line: ours instead
                ids: Any = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                              add_generation_prompt=True, tokenize=True,
                                                              return_dict=False)
            if model_limit is not None and len(ids) >= model_limit:
                short = text if len(text) <= 40 else text[:37] + "..."
                raise UserError(f"train.sample_prompts[{i}] ({short!r}, {len(text):,} characters): {len(ids):,} "
                                f"tokens with the run's prompt format, the model's limit is {model_limit:,}; give "
                                "a shorter prompt")
            self.ids.append([int(t) for t in ids])
        self.limit = limit

    def answers(self, model: torch.nn.Module, device: torch.device, *, lockstep: bool) -> list[str]:
        """The answers of ``model`` as it is now (eval mode for the while, then as it was)."""
        was = model.training
        model.eval()
        try:
            return [self.tokenizer.decode(self._greedy(model, ids, device, lockstep), skip_special_tokens=True)
                    for ids in self.ids]
        finally:
            model.train(was)

    @torch.no_grad()
    def _greedy(self, model: torch.nn.Module, ids: list[int], device: torch.device, lockstep: bool) -> list[int]:
        eos = self.tokenizer.eos_token_id
        seq = torch.tensor([ids], device=device)
        new: list[int] = []
        while len(new) < SAMPLE_TOKENS and seq.shape[1] < self.limit:
            token = model(input_ids=seq, use_cache=False).logits[0, -1].argmax()
            if lockstep:  # fsdp: every rank goes on with rank 0's token (the next forward is a collective)
                dist.broadcast(token, src=0)
            t = int(token)  # sync point: one per new token
            if t == eos:
                break
            new.append(t)
            seq = torch.cat([seq, token.view(1, 1)], dim=1)
        return new


    def show(self, step: int, total: int, model: torch.nn.Module, device: torch.device, *, rank: int,
             lockstep: bool, say: Callable[[str], None], log: Callable[[dict[str, Any]], None] | None) -> None:
        """At an evaluation: answer every prompt (rank 0; every rank under fsdp), print each
        answer with ``say`` and log it with ``log`` (rank 0's metrics.jsonl; None elsewhere)."""
        if rank != 0 and not lockstep:
            return
        for prompt, answer in zip(self.prompts, self.answers(model, device, lockstep=lockstep)):
            say(sample_line(step, total, prompt, answer))
            if log is not None:
                log({"kind": "sample", "step": step, "prompt": prompt, "answer": answer})


def sample_line(step: int, total: int, prompt: str, answer: str) -> str:
    """The console line of one sample, as rich markup (the texts escaped: answers hold any text)."""
    width = len(str(total))
    short = answer.strip().replace("\n", " ")
    return escape(f"step {step:>{width}}/{total} | sample {prompt!r} -> {short[:120]!r}")


def check_sample_prompts(plan: RunPlan) -> None:
    """Refuse a ``train.sample_prompts`` entry the model has no room to answer, before the plan
    is printed (zfctl/train/preflight.py): the tokenizer's count against the model's position
    limit in the plan (``model.config``, or a hub model's ``model.arch``). Where the plan does not
    say the limit, or the tokenizer is not at hand without a download it cannot make, the run
    refuses it once the model is loaded (:class:`SamplePrompts`)."""
    from zfctl.errors import ConfigError
    from zfctl.plan.validate import position_limit

    if not plan.train.sample_prompts:
        return
    found = position_limit((plan.model.config if plan.model.source == "config" else plan.model.arch) or {})
    if found is None:
        return
    try:
        SamplePrompts(plan, model_config=dict([found]))
    except ConfigError as e:  # the tokenizer cannot be had now (offline, not cached): the run's check
        if e.key != "model.tokenizer":
            raise
