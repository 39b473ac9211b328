"""Prompt files for ``zfctl generate --prompts FILE``: read and checked whole before a model loads.

Three layouts, by the file's suffix. A ``.jsonl`` file holds one JSON value per line: a string
(the prompt), or an object with ``prompt`` and optionally ``system`` (a chat run's system turn for
that prompt). A ``.json`` file is read as JSON: an array of those values (``["...", {"prompt":
"..."}]``), one such value, or JSON lines; anything else is refused with that hint. Any other
file holds one prompt per line, as typed. Blank lines are skipped; lines are numbered from 1, as
editors number them, in every error.

A prompts file is text: a control character other than tab and the line ends (a NUL, an escape
sequence, DEL) is refused, naming its line, rather than answered as a prompt and echoed back.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zfctl.errors import UserError

JSON_SUFFIXES = (".json", ".jsonl")
# What a JSON prompts file may hold, for the errors that refuse one.
JSON_HINT = ('write each prompt as a JSON string or {"prompt": "..."}, in an array (a .json file) or one per '
             "line, or give a .txt file for one prompt per line as typed")
# Control characters a text file may hold: tab and the line ends.
TEXT_CONTROLS = frozenset("\t\n\r")
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a file: its text, its own system turn (None: --system's, if any), its line."""

    text: str
    system: str | None
    line: int


def read_prompts(path: Path) -> list[Prompt]:
    """The prompts of ``path``; a UserError naming the file and line for anything else."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--prompts {path}: is a folder; give a text file with one prompt per line, or a .jsonl file")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise UserError(f"--prompts {path}: no such file; give a text file with one prompt per line") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts {path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    bad = _first_control(text)
    if bad is not None:
        raise UserError(f"--prompts {path}: line {text.count(chr(10), 0, bad) + 1} holds the control character "
                        f"{text[bad]!r}: not a text file; give prompts as plain UTF-8 text (tabs and newlines are fine)")
    suffix = path.suffix.lower()
    if suffix == ".json" and text.lstrip().startswith("["):
        out = _json_array(path, text)
    elif suffix == ".json" and (whole := _one_value(text)) is not None:
        out = [_json_value(path, text.count("\n", 0, len(text) - len(text.lstrip())) + 1, whole)]
    else:
        out = [_json_prompt(path, n, raw) if suffix in JSON_SUFFIXES else Prompt(raw.strip(), None, n)
               for n, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not out:
        raise UserError(f"--prompts {path}: holds no prompt (every line is blank)")
    return out


def _first_control(text: str) -> int | None:
    """The index of ``text``'s first control character (Unicode category Cc) other than tab and
    the line ends; None when it has none."""
    return next((i for i, c in enumerate(text) if c not in TEXT_CONTROLS and unicodedata.category(c) == "Cc"), None)


def _json_array(path: Path, text: str) -> list[Prompt]:
    """A ``.json`` file holding one array: each item a prompt, numbered by the line it starts on."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--prompts {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                        f"{JSON_HINT}") from None
    if not items:
        raise UserError(f"--prompts {path}: holds no prompt (the array is empty)")
    return [_json_value(path, line, item) for line, item in zip(_item_lines(text), items)]


def _one_value(text: str) -> object | None:
    """The JSON object or string that is the whole of ``text`` (one prompt, perhaps over several
    lines); None for anything else (JSON lines, or not JSON)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, (dict, str)) else None


def _item_lines(text: str) -> list[int]:
    """The line each item of the JSON array ``text`` (valid JSON) starts on."""
    decoder = json.JSONDecoder()
    lines: list[int] = []
    i = _skip_space(text, 0) + 1  # past the "["
    while True:
        i = _skip_space(text, i)
        if text[i] == "]":
            return lines
        lines.append(text.count("\n", 0, i) + 1)
        i = _skip_space(text, decoder.raw_decode(text, i)[1])
        i += text[i] == ","


def _skip_space(text: str, i: int) -> int:
    m = _JSON_SPACE.match(text, i)
    return m.end() if m else i


def _json_prompt(path: Path, n: int, raw: str) -> Prompt:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(f"--prompts {path}: line {n} is not valid JSON ({e.msg}); {JSON_HINT}") from None
    return _json_value(path, n, value)


def _json_value(path: Path, n: int, value: Any) -> Prompt:
    where = f"--prompts {path}: line {n}"
    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, dict):
        raise UserError(f'{where}: expected a string or {{"prompt": ...}}, got {type(value).__name__}')
    unknown = sorted(set(value) - {"prompt", "system"})
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; a line holds \"prompt\" and optionally \"system\"")
    prompt, system = value.get("prompt"), value.get("system")
    if not isinstance(prompt, str) or not prompt.strip():
        what = "is missing" if "prompt" not in value else "is null" if prompt is None else (
            "is empty" if isinstance(prompt, str) else f"must be a string, got {type(prompt).__name__}")
        raise UserError(f'{where}: "prompt" {what}; give the text to answer')
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise UserError(f'{where}: "system" must be a non-empty string (or left out)')
    for key, text in (("prompt", prompt), ("system", system or "")):
        bad = _first_control(text)
        if bad is not None:  # an escaped one (\u001b): the file is text, the prompt is not
            raise UserError(f'{where}: "{key}" holds the control character {text[bad]!r}; give plain text '
                            "(tabs and newlines are fine)")
    return Prompt(prompt, system, n)
