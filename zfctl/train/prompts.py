"""Prompt files for ``zfctl generate --prompts FILE``: read and checked whole before a model loads.

Two layouts. A ``.jsonl`` file holds one JSON value per line: a string (the prompt), or an object
with ``prompt`` and optionally ``system`` (a chat run's system turn for that prompt). Any other
file holds one prompt per line, as typed. Blank lines are skipped in both; lines are numbered
from 1, as editors number them, in every error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from zfctl.errors import UserError


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
    as_json = path.suffix.lower() == ".jsonl"
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        out.append(_json_prompt(path, n, raw) if as_json else Prompt(raw.strip(), None, n))
    if not out:
        raise UserError(f"--prompts {path}: holds no prompt (every line is blank)")
    return out


def _json_prompt(path: Path, n: int, raw: str) -> Prompt:
    where = f"--prompts {path}: line {n}"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not valid JSON ({e.msg}); write each prompt as a JSON string or "
                        '{"prompt": "..."}, or give a file not ending in .jsonl for one prompt per line') from None
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
    return Prompt(prompt, system, n)
