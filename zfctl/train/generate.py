"""`generate`: try a fine-tuned model on a prompt, from a run folder, a checkpoint or an export.

The prompt is rendered in the format the run trained on (zfctl/train/data/prompt_format.py): the
alpaca template's ``### Instruction: ... ### Response:`` around the text, or the chat template
for a chat run. From a run folder or checkpoint the weights are the finished model (the
in-flight CPU update installed, as ``zfctl export`` writes them) and the format comes from the
saved plan; from an export folder both come from the folder itself, whose ``chat_template`` export
wrote. Either way the prompt is built by the tokenizer's ``apply_chat_template`` with that same
template, so a run and its export give the same tokens, and plain transformers on the export too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TextStreamer

from zfctl.errors import UserError
from zfctl.plan.io import load_plan_yaml
from zfctl.train import checkpoint as ck
from zfctl.train.data.prompt_format import prompt_template
from zfctl.train.lock import held
from zfctl.train.weights import EXPORT_MARKER, final_weights, final_weights_files, quiet_transformers


@dataclass
class Generator:
    """A loaded model and tokenizer with the run's prompt format; ``multi_turn``: the format holds
    a conversation (template chat), so an interactive session keeps its history."""

    model: Any  # a transformers causal LM, in eval mode
    tokenizer: Any
    source: str  # what was loaded, for the first line the user sees
    multi_turn: bool
    history: list[dict[str, str]] = field(default_factory=list)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of ``messages`` rendered with the generation prompt, as training saw them."""
        with hf_errors_only():  # a prompt past model_max_length: zfctl's own line says so (generate)
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        return [int(i) for i in ids]

    def messages(self, text: str, system: str | None = None) -> list[dict[str, str]]:
        """One exchange's messages: the system turn (a chat run's), then ``text`` as the user's."""
        return [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": text}]

    def check_length(self, messages: list[dict[str, str]], what: str = "--prompt") -> list[int]:
        """The prompt's token ids; refused when they leave no room to answer (``what``: where it came from)."""
        ids, limit = self.prompt_ids(messages), _position_limit(self.model)
        if limit is not None and len(ids) >= limit:
            raise UserError(f"{what}: {len(ids)} tokens with its format, the model's limit is {limit}; give a "
                            "shorter prompt")
        return ids

    def answer(self, text: str, *, system: str | None = None, max_new_tokens: int, temperature: float) -> str:
        """The answer to ``text`` alone (no earlier turns), decoded."""
        new = self.generate(self.messages(text, system), max_new_tokens=max_new_tokens, temperature=temperature)
        return str(self.tokenizer.decode(new, skip_special_tokens=True))

    def generate(self, messages: list[dict[str, str]], *, max_new_tokens: int, temperature: float,
                 on_text: Callable[[str], None] | None = None) -> list[int]:
        """The new token ids for ``messages`` (greedy when ``temperature`` is 0); ``on_text``
        receives the decoded text as it is produced."""
        return self.continue_ids(self.check_length(messages), max_new_tokens=max_new_tokens,
                                 temperature=temperature, on_text=on_text)

    def continue_ids(self, prompt: list[int], *, max_new_tokens: int, temperature: float,
                     on_text: Callable[[str], None] | None = None) -> list[int]:
        """The new token ids after ``prompt``, token ids already in the run's format (``generate``
        renders them; ``zfctl evaluate`` takes them from the tokenised records)."""
        ids = torch.tensor([prompt], device=self.model.device)
        limit = _position_limit(self.model)
        if limit is not None:
            max_new_tokens = min(max_new_tokens, limit - ids.shape[1])
        streamer = None
        if on_text is not None:
            streamer = _Streamer(self.tokenizer, on_text)
        eos = self.tokenizer.eos_token_id
        sampling: dict[str, Any] = ({"do_sample": True, "temperature": temperature} if temperature > 0 else
                                    {"do_sample": False, "temperature": None, "top_p": None, "top_k": None})
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                                      streamer=streamer, **sampling)
        return [int(i) for i in out[0, ids.shape[1]:]]

    def reply(self, text: str, *, max_new_tokens: int, temperature: float,
              on_text: Callable[[str], None] | None = None, system: str | None = None) -> str:
        """One turn of an interactive session: the answer to ``text`` (after the earlier turns,
        for a chat run; alone otherwise, as the run trained on one exchange per sequence).
        ``system``: a chat run's system turn, first in the conversation."""
        if self.multi_turn and self.history:
            messages = [*self.history, {"role": "user", "content": text}]
        else:
            messages = self.messages(text, system)
        new = self.generate(messages, max_new_tokens=max_new_tokens, temperature=temperature, on_text=on_text)
        answer = self.tokenizer.decode(new, skip_special_tokens=True)
        if self.multi_turn:
            self.history = [*messages, {"role": "assistant", "content": answer}]
        return answer


@contextlib.contextmanager
def hf_errors_only() -> Iterator[None]:
    """transformers' log at ERROR for a moment: its "Token indices sequence length is longer than
    the specified maximum" warning would print a raw line before zfctl's own error for that prompt
    (generate's, and train.sample_prompts', zfctl/train/samples.py)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(was)


class _Streamer(TextStreamer):
    """transformers' TextStreamer (word-wise decoding, the prompt skipped), writing to a callback."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None]) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self._on_text = on_text

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self._on_text(text)


def _position_limit(model: Any) -> int | None:
    from zfctl.plan.validate import position_limit

    found = position_limit(getattr(model, "config", None))
    return None if found is None else found[1]


def is_export(path: Path) -> bool:
    """A folder ``from_pretrained`` loads (an export, or any save_pretrained folder)."""
    return path.is_dir() and (path / "config.json").is_file() and not (path / ck.CHECKPOINTS).is_dir() \
        and not (path / ck.META).is_file()


def load_generator(path: Path, device: torch.device, notes: list[str]) -> Generator:
    """The model and prompt format of a run folder, a checkpoint folder or an export folder."""
    path = Path(path)
    if is_export(path):
        return _from_export(path, device, notes)
    info = ck.resolve_checkpoint(path, notes)
    ck.verify_checkpoint(info, final_weights_files(info))
    plan = load_plan_yaml(info.path / ck.PLAN_FILE)
    from zfctl.train.models.load import load_tokenizer

    tokenizer = load_tokenizer(plan.model)
    tokenizer.chat_template = prompt_template(plan.data, tokenizer)
    # The lock, as export takes it: a live run could rotate this checkpoint away mid-read.
    run_dir = info.path.parent.parent if info.path.parent.name == ck.CHECKPOINTS else None
    with _maybe_held(run_dir):
        model: Any = final_weights(info, plan)
    return Generator(model.to(device).eval(), tokenizer, f"{info.path} (step {info.step})",
                     multi_turn=plan.data.template == "chat")


def _maybe_held(run_dir: Path | None) -> contextlib.AbstractContextManager:
    return held(run_dir, optional=True) if run_dir is not None else contextlib.nullcontext()


# Files of which a save_pretrained tokenizer holds at least one (fast: tokenizer.json; slow:
# sentencepiece's model, or a BPE/WordPiece vocabulary); tokenizer_config.json alone names a class.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _from_export(path: Path, device: torch.device, notes: list[str]) -> Generator:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        have = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
        raise UserError(f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}; it holds {have}); "
                        "give the run folder instead, or write a complete export with `zfctl export RUN "
                        f"--output {path} --force` (zfctl export saves the tokenizer next to the model)")
    with quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            model: Any = AutoModelForCausalLM.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as e:  # a partial or foreign folder: what transformers says, once
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{path} cannot be loaded as a model folder ({first}); give the run folder instead, "
                            f"or write a complete export with `zfctl export RUN --output {path} --force`") from None
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"{path}: its tokenizer has no chat_template, so the prompt format the model was "
                        "trained on is unknown; give the run folder instead, or re-export it with zfctl export")
    template = "chat"
    if (path / "zfctl-plan.yaml").is_file():
        template = load_plan_yaml(path / "zfctl-plan.yaml").data.template
    elif not (path / EXPORT_MARKER).is_file():
        notes.append(f"{path} was not written by zfctl export: its own chat template renders the prompt")
    return Generator(model.to(device).eval(), tokenizer, str(path), multi_turn=template == "chat")


def template_of(path: Path) -> str:
    """The prompt format ``path`` (a run, checkpoint or export folder) trained with, read from its
    plan without loading a model: ``data.template`` (an export without zfctl's plan: chat, as its
    own chat template renders conversations)."""
    path = Path(path)
    if is_export(path):
        plan_file = path / "zfctl-plan.yaml"
        return load_plan_yaml(plan_file).data.template if plan_file.is_file() else "chat"
    return load_plan_yaml(ck.resolve_checkpoint(path).path / ck.PLAN_FILE).data.template


def check_system(path: Path, system: str | None, *, wanted: bool) -> None:
    """Refuse a system turn (``--system``, or a prompt file's ``system``) for a run whose format
    has none: only template chat renders one, and a model trained without it never saw one."""
    if not wanted:
        return
    template = template_of(path)
    if template != "chat":
        raise UserError(f"--system: {path} trained with data.template={template}, whose prompt format has no system "
                        "turn; leave --system (and the prompt file's 'system' keys) out, or use a run trained with "
                        "data.template=chat")


def read_turns(read: Callable[[str], str]) -> Iterator[str]:
    """The user's lines of an interactive session (blank ones skipped), until EOF (Ctrl-D) or Ctrl-C."""
    while True:
        try:
            text = read(">>> ").strip()
        except (EOFError, KeyboardInterrupt):
            return
        if text:
            yield text
