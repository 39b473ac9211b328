"""Chat conversations -> token sequences with the loss on the assistant's turns and nothing else.

A record holds one conversation, OpenAI-style ``{"messages": [{"role", "content"}, ...]}`` (roles
system, user, assistant) or ShareGPT-style ``{"conversations": [{"from", "value"}, ...]}`` (human,
gpt, system: mapped to user, assistant, system). :func:`normalize` checks it and raises a
RecordError naming the file, the record index and the field for an unknown role, an empty
conversation, a conversation without an assistant turn, one that opens with an answer, or two
user (or two assistant) turns in a row.

**Rendering** is the tokenizer's own chat template through ``apply_chat_template``; a tokenizer
without one gets zfctl's default (:func:`chat_template`). **The mask comes from per-turn
rendering**, never from searching the text: for the assistant turn at index i,
``render(messages[:i], add_generation_prompt=True)`` ends where the turn's content starts and
``render(messages[:i+1])`` ends after the turn. Each rendering must extend the previous one (a
template that rewrites earlier turns once a later one is added is refused, naming the turn), so
the conversation's text is cut at those offsets into (context, answer) pieces, and the pieces are
tokenised separately: every token belongs to exactly one piece, whatever the tokenizer would have
merged across a boundary. This is also how the model meets the text at inference, where the
prompt ending in the generation header is tokenised on its own. Inside an answer the loss covers
the tokens up to and including its last special token, the end-of-turn token (``<|im_end|>``,
``<|eot_id|>``, ``</s>``); what a template writes after it (ChatML's newline) belongs to no turn
and is not trained. An answer piece holding no special token is trained whole.

**Truncation** keeps whole exchanges (context + answer): the longest run of them from the start
that fits ``max_length``. When even the first does not fit, it is cut at ``max_length`` and keeps
the part of the answer that fits; a sequence left with no trained token is dropped and counted.
Text after the last assistant turn (an unanswered question) carries no loss and is left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache

from zfctl.resources import presets_root
from zfctl.train.data.templates import IGNORE_INDEX, RecordError

# (record field, role key, content key, role names -> the roles chat templates know)
FORMATS = (
    ("messages", "role", "content", {"system": "system", "user": "user", "assistant": "assistant"}),
    ("conversations", "from", "value", {"system": "system", "human": "user", "gpt": "assistant"}),
)
CHAT_FIELDS = tuple(f[0] for f in FORMATS)
_CHUNK = 256  # conversations per batched tokenizer call


@dataclass
class Conversation:
    """One checked record: its messages as chat templates expect them, and where it came from."""

    index: int  # record index in its source
    field: str  # "messages" or "conversations", for error messages
    messages: list[dict[str, str]]  # [{"role": system|user|assistant, "content": str}]


@dataclass
class Exchange:
    """One assistant turn and the context before it, tokenised; ``trained`` ids of ``answer`` are in the loss."""

    context: list[int]
    answer: list[int]
    trained: int  # the answer's first `trained` tokens carry labels (through its end-of-turn token)


def normalize(rec: object, where: str, index: int) -> Conversation:
    """The record's conversation with roles mapped, or a RecordError naming what is wrong."""
    if not isinstance(rec, dict):
        raise RecordError(where, index, "<record>", f"must be an object with fields, got {type(rec).__name__}")
    found = next((f for f in FORMATS if f[0] in rec and rec[f[0]] is not None), None)
    if found is None:
        have = ", ".join(map(repr, rec)) or "no fields"
        raise RecordError(where, index, "messages", f"is missing (the record has {have}); a chat record holds "
                          "'messages' (role/content turns) or 'conversations' (from/value turns)")
    field, role_key, content_key, roles = found
    turns = rec[field]
    if not isinstance(turns, list):
        raise RecordError(where, index, field, f"must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise RecordError(where, index, field, "is empty: a conversation needs a user turn and an assistant turn")
    messages = []
    for i, turn in enumerate(turns):
        name = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(where, index, name, f"must be an object with {role_key!r} and {content_key!r}, "
                              f"got {type(turn).__name__}")
        role = turn.get(role_key)
        if role not in roles:
            what = "is missing" if role is None else f"is {role!r}"
            raise RecordError(where, index, f"{name}.{role_key}", f"{what}: use {', '.join(roles)}")
        content = turn.get(content_key)
        if not isinstance(content, str):
            what = ("is null; give it a text (or drop the turn)" if content_key in turn and content is None else
                    "is missing" if content is None else f"must be a string, got {type(content).__name__}")
            raise RecordError(where, index, f"{name}.{content_key}", what)
        if not content.strip():
            raise RecordError(where, index, f"{name}.{content_key}", "is empty")
        messages.append({"role": roles[role], "content": content})
    if messages[0]["role"] == "assistant":
        raise RecordError(where, index, f"{field}[0].{role_key}", f"is {turns[0][role_key]!r}: the conversation "
                          "opens with an answer to nothing; start it with a system or user turn")
    for i in range(1, len(messages)):
        # Two user turns in a row (or two answers) are a merge or export mistake: the second turn's
        # context would train as if the first had been answered. Most chat templates refuse it too.
        if messages[i]["role"] == messages[i - 1]["role"] != "system":
            raise RecordError(where, index, f"{field}[{i}].{role_key}", f"is {turns[i][role_key]!r} again, right "
                              f"after {field}[{i - 1}]: turns must alternate between the user and the assistant; "
                              "merge the two turns into one, or add the missing one between them")
    if not any(m["role"] == "assistant" for m in messages):
        assistant = next(k for k, v in roles.items() if v == "assistant")
        raise RecordError(where, index, field, f"has no {assistant} turn: nothing to train on")
    return Conversation(index, field, messages)


@lru_cache(maxsize=1)
def default_chat_template() -> str:
    """zfctl's default template: ChatML's layout with the tokenizer's BOS/EOS as turn markers.

    Shipped with the embedded tokenizer (presets/tokenizers/embedded/chat_template.jinja, which
    transformers loads with it) and used for any tokenizer that has no chat template of its own.
    """
    return (presets_root() / "tokenizers" / "embedded" / "chat_template.jinja").read_text(encoding="utf-8")


def chat_template(tokenizer) -> str:
    """The template a chat run renders with: the tokenizer's own, else zfctl's default."""
    own = getattr(tokenizer, "chat_template", None)
    return own if isinstance(own, str) and own else default_chat_template()


def render(conv: Conversation, tokenizer, template: str, where: str) -> list[tuple[str, str]]:
    """(context, answer) text per assistant turn; joined in order they are the rendered conversation
    up to the end of its last assistant turn (module docstring: how the offsets are found)."""
    ends = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    try:
        opens = tokenizer.apply_chat_template([conv.messages[:i] for i in ends], chat_template=template,
                                              add_generation_prompt=True, tokenize=False)
        closes = tokenizer.apply_chat_template([conv.messages[:i + 1] for i in ends], chat_template=template,
                                               tokenize=False)
    except Exception as e:  # jinja's TemplateError (a template's own raise_exception), TypeError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RecordError(where, conv.index, conv.field, f"cannot be rendered by the chat template: {first}") from e
    pieces, done = [], ""
    for i, head, full in zip(ends, opens, closes, strict=True):
        if not (head.startswith(done) and full.startswith(head)):
            raise RecordError(where, conv.index, f"{conv.field}[{i}]", "renders differently once later turns "
                              "are added (the chat template rewrites earlier turns), so the assistant's tokens "
                              "cannot be told apart; use a template that renders each turn once "
                              "(set the tokenizer's chat_template)")
        pieces.append((head[len(done):], full[len(head):]))
        done = full
    return pieces


def special_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens: the candidates for an answer's end-of-turn token."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def tokenize(convs: Iterable[Conversation], tokenizer, template: str, where: str) -> Iterator[list[Exchange]]:
    """Each conversation's exchanges, tokenised piece by piece in batched tokenizer calls."""
    special = special_ids(tokenizer)
    batch: list[tuple[Conversation, list[tuple[str, str]]]] = []

    def flush() -> Iterator[list[Exchange]]:
        texts = [t for _, pieces in batch for pair in pieces for t in pair]
        ids = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
        for conv, pieces in batch:
            exchanges = []
            for _ in pieces:
                context, answer = next(ids), next(ids)
                if not answer:
                    raise RecordError(where, conv.index, conv.field, "renders an assistant turn as no tokens")
                last = max((k for k, t in enumerate(answer) if t in special), default=len(answer) - 1)
                exchanges.append(Exchange(context, answer, last + 1))
            yield exchanges
        batch.clear()

    for conv in convs:
        batch.append((conv, render(conv, tokenizer, template, where)))
        if len(batch) == _CHUNK:
            yield from flush()
    if batch:
        yield from flush()


def fit(exchanges: list[Exchange], max_length: int) -> tuple[list[int], list[int]] | None:
    """(input_ids, labels) of the whole exchanges that fit in ``max_length`` (the first one cut if it
    alone does not); None when no trained token is left."""
    ids: list[int] = []
    labels: list[int] = []
    for ex in exchanges:
        if ids and len(ids) + len(ex.context) + len(ex.answer) > max_length:
            break  # keep whole turns: the next exchange does not fit
        ids += ex.context + ex.answer
        labels += [IGNORE_INDEX] * len(ex.context) + ex.answer[:ex.trained]
        labels += [IGNORE_INDEX] * (len(ex.answer) - ex.trained)
    ids, labels = ids[:max_length], labels[:max_length]  # only the first exchange can be longer
    return (ids, labels) if any(x != IGNORE_INDEX for x in labels) else None


def sequences(convs: Iterable[Conversation], tokenizer, max_length: int, where: str,
              dropped: list[int]) -> Iterator[tuple[list[int], list[int]]]:
    """Truncated (input_ids, labels) per conversation; those with no trained token left are
    counted in ``dropped[0]`` instead."""
    for exchanges in tokenize(convs, tokenizer, chat_template(tokenizer), where):
        seq = fit(exchanges, max_length)
        if seq is None:
            dropped[0] += 1
        else:
            yield seq
