"""Prompt templates: raw records -> (input_ids, labels) with the loss only where it belongs.

(Template ``chat`` renders with the tokenizer's own chat template instead: zfctl/train/data/chat.py.)

Every template renders a record into a *prompt* and a *response*. The sequence is
``[<s>] + prompt tokens + response tokens + [</s>]``; labels are -100 on ``<s>`` and the prompt,
so the loss covers exactly the response and the EOS that ends it. Prompt and response are
tokenised separately (batched, in the tokenizer's Rust code), which makes the mask boundary exact
whatever merges the tokenizer would have made across it.

Records are checked as they are rendered: a missing field, a wrong type or an empty text raises a
UserError naming the file, the record index and the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from zfctl.errors import UserError
from zfctl.plan.schema import DataConfig

IGNORE_INDEX = -100  # what torch's cross-entropy (and HF's loss) skips
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
CLASSIFICATION_PROMPT = "### Text:\n{text}\n\n### Label:\n"
TEMPLATE_VERSION = 3  # bump when the rendering changes: it is part of the data cache key (3: data.fields)
_CHUNK = 1024  # records per batched tokenizer call


@dataclass
class Rendered:
    """One record as text, before tokenisation."""

    index: int  # record index in its source (after nothing: the user's numbering)
    prompt: str
    response: str
    response_field: str  # for "empty after templating" errors


class RecordError(UserError):
    """A bad record, named by file, number and field. ``index`` counts from 0 (the records' list);
    the message counts from 1, as editors number lines (record 3 of a JSON lines file is line 3)."""

    def __init__(self, where: str, index: int, field: str, problem: str) -> None:
        super().__init__(f"{where}: record {index + 1}: field {field!r} {problem}")


def _text(rec: dict, field: str, where: str, index: int, *, required: bool = True, role: str | None = None) -> str:
    """rec[field] as a non-empty string, or a RecordError saying what is wrong with it. ``role``:
    the template's name for the field (data.fields maps it), which a missing field's error names
    with the mapping that would fix it."""
    if field not in rec or rec[field] is None:
        if not required:
            return ""
        if field in rec:  # present, but JSON null (or an empty parquet cell)
            raise RecordError(where, index, field, "is null; give it a text (or drop the record)")
        have = ", ".join(map(repr, rec)) or "no fields"
        if where.lower().endswith(".csv") and _data_like(rec):
            raise RecordError(where, index, field, f"is missing: a CSV's first line names its columns, and this "
                              f"file's ({have}) reads as a record, not as names: the header row is missing; add "
                              f"one as the first line, e.g. {','.join(_CSV_HEADERS.get(role or '', [field]))}")
        fix = ""
        if role is not None:
            fix = (f"; if another field holds it, --set data.fields.{role}=THAT_FIELD"
                   + ("" if role != "instruction" else
                      ", or --set data.template=prompt_completion for prompt/completion records"))
        raise RecordError(where, index, field, f"is missing (the record has {have}){fix}")
    value = rec[field]
    if not isinstance(value, str):
        raise RecordError(where, index, field, f"must be a string, got {type(value).__name__} {value!r:.40}")
    if required and not value.strip():
        raise RecordError(where, index, field, "is empty")
    return value


# A header row to suggest for a CSV without one, by the template role whose column is missing.
_CSV_HEADERS = {"instruction": ["instruction", "output"], "output": ["instruction", "output"],
                "prompt": ["prompt", "completion"], "completion": ["prompt", "completion"]}


def _data_like(rec: dict) -> bool:
    """Column names that read as data, not names: a number, or text with punctuation such as '?'
    or '+' (a CSV whose first line is a record, read as its header)."""
    def data(name: object) -> bool:
        text = str(name).strip()
        return not text or text.replace(".", "", 1).lstrip("-").isdigit() or not all(
            c.isalnum() or c in " _-." for c in text)
    return any(data(k) for k in rec)


def _label_word(rec: dict, cfg: DataConfig, where: str, index: int) -> str:
    """The classification label as the word the model should produce."""
    field = cfg.label_field
    if field in rec and rec[field] is None:
        raise RecordError(where, index, field, "is null; give it a label (or drop the record)")
    if field not in rec:
        raise RecordError(where, index, field, f"is missing (the record has {', '.join(map(repr, rec))})")
    label = rec[field]
    if isinstance(label, str) and label.strip().lstrip("-").isdigit() and cfg.label_names:
        label = int(label)  # CSV cells are text
    if isinstance(label, bool) or not isinstance(label, (int, str)):
        raise RecordError(where, index, field, f"must be an int or a string, got {type(label).__name__}")
    if isinstance(label, str):
        if not label.strip():
            raise RecordError(where, index, field, "is empty")
        return label
    if cfg.label_names:
        if not 0 <= label < len(cfg.label_names):
            raise RecordError(
                where,
                index,
                field,
                f"is {label}, outside data.label_names "
                f"(0..{len(cfg.label_names) - 1}); an unlabelled test split?",
            )
        return str(cfg.label_names[label])
    if label < 0:
        raise RecordError(where, index, field, f"is {label}: an unlabelled test split? name another split")
    return str(label)


def render(rec: object, cfg: DataConfig, where: str, index: int) -> Rendered:
    """Apply `cfg.template` to one record."""
    if not isinstance(rec, dict):
        raise RecordError(
            where, index, "<record>", f"must be an object with fields, got {type(rec).__name__}"
        )
    fields = cfg.fields or {}

    def field(role: str, *, required: bool = True) -> str:
        return _text(rec, fields.get(role, role), where, index, required=required, role=role)

    if cfg.template == "alpaca":
        instruction = field("instruction")
        inp = field("input", required=False)
        output = field("output")
        prompt = (ALPACA_PROMPT if inp.strip() else ALPACA_PROMPT_NO_INPUT).format(
            instruction=instruction, input=inp
        )
        return Rendered(index, prompt, output, fields.get("output", "output"))
    if cfg.template == "prompt_completion":  # TRL/OpenAI: the prompt is the text as the user wrote it
        return Rendered(index, field("prompt"), field("completion"), fields.get("completion", "completion"))
    if cfg.template == "text":
        return Rendered(index, "", _text(rec, cfg.text_field, where, index), cfg.text_field)
    if cfg.template == "classification":
        text = _text(rec, cfg.text_field, where, index)
        return Rendered(
            index,
            CLASSIFICATION_PROMPT.format(text=text),
            _label_word(rec, cfg, where, index),
            cfg.label_field,
        )
    raise UserError(f"data.template={cfg.template!r}: use alpaca, prompt_completion, text, classification or chat")


def tokenize(rendered: Iterable[Rendered], tokenizer, where: str) -> Iterator[tuple[list[int], list[int]]]:
    """(input_ids, labels) per rendered record, untruncated, tokenised in batches."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    head = [bos] if bos is not None else []
    tail = [eos] if eos is not None else []
    batch: list[Rendered] = []

    def flush() -> Iterator[tuple[list[int], list[int]]]:
        prompts = tokenizer([r.prompt for r in batch], add_special_tokens=False)["input_ids"]
        responses = tokenizer([r.response for r in batch], add_special_tokens=False)["input_ids"]
        for r, p, a in zip(batch, prompts, responses):
            if not a:
                raise RecordError(where, r.index, r.response_field, "is empty after tokenisation")
            ids = head + p + a + tail
            yield ids, [IGNORE_INDEX] * (len(head) + len(p)) + a + tail
        batch.clear()

    for r in rendered:
        batch.append(r)
        if len(batch) == _CHUNK:
            yield from flush()
    if batch:
        yield from flush()


def truncate(
    examples: Iterable[tuple[list[int], list[int]]], max_length: int, dropped: list[int]
) -> Iterator[tuple[list[int], list[int]]]:
    """Cut each sequence to max_length; drop (and count in dropped[0]) those left with no label."""
    for ids, labels in examples:
        ids, labels = ids[:max_length], labels[:max_length]
        if all(x == IGNORE_INDEX for x in labels):  # the prompt alone filled max_length
            dropped[0] += 1
            continue
        yield ids, labels


Packed = tuple[list[int], list[int], list[int]]  # input_ids, labels, position_ids of one block


def pack(
    examples: Iterable[tuple[list[int], list[int]]], max_length: int, *, split: bool
) -> Iterator[Packed]:
    """Place sequences one after another into max_length blocks (the last may be shorter).

    ``split`` (template text): a sequence that does not fit in what is left of a block fills it
    and continues in the next, so no token is lost. Without it (chat, whose conversations are
    truncated to max_length first) a sequence that does not fit starts the next block.
    Positions restart at 0 for each sequence (and for each continued part), and the first token
    of each gets no label: nothing before it in the block may predict it. The loop passes the
    positions to the model without an attention mask, and transformers then keeps attention
    inside each sequence (zfctl/train/loss.py, ``model_inputs``), so a block trains exactly as its
    sequences would one by one. Blocks without a label are skipped.
    """
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []

    def close() -> Iterator[Packed]:
        if any(x != IGNORE_INDEX for x in labels):  # else nothing to learn from
            yield ids[:], labels[:], positions[:]
        ids.clear()
        labels.clear()
        positions.clear()

    for seq_ids, seq_labels in examples:
        while seq_ids:
            room = max_length - len(ids)
            if len(seq_ids) > room and ids and not split:
                yield from close()
                continue
            take = min(room, len(seq_ids))
            ids.extend(seq_ids[:take])
            labels.extend([IGNORE_INDEX, *seq_labels[1:take]])
            positions.extend(range(take))
            seq_ids, seq_labels = seq_ids[take:], seq_labels[take:]
            if len(ids) == max_length:
                yield from close()
    if ids:
        yield from close()
