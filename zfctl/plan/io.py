"""RunPlan <-> plain dicts <-> YAML files.

`plan_from_dict` is the one door into a RunPlan from outside data: unknown keys are rejected with
the nearest valid key suggested, keys of older zfctl versions are mapped with a note
(`legacy.py`), values are coerced to the schema's types, and the result is validated. `dump_plan_yaml` writes the plan with each field's help text as a comment, so the
`plan.yaml` saved in every checkpoint documents itself; the write is atomic (temp file + rename)
so a crash never leaves half a plan behind. This module imports nothing from the CLI.
"""

from __future__ import annotations

import json
import os
import textwrap
import uuid
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from zfctl.errors import ConfigError, UserError
from zfctl.plan.coerce import field_types, section_from_dict, suggest
from zfctl.plan.legacy import upgrade_fragment
from zfctl.plan.schema import SECTIONS, RunPlan
from zfctl.plan.validate import validate_plan


def to_plain(value: Any) -> Any:
    """Tuples -> lists, recursively, so YAML and JSON can hold the value."""
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def plan_to_dict(plan: RunPlan) -> dict:
    """A nested dict of plain values (lists, not tuples), sections in schema order."""
    return {name: to_plain(asdict(getattr(plan, name))) for name in SECTIONS}


def check_sections(data: Any, where: str = "plan") -> dict:
    """Reject a non-mapping or unknown top-level section (nearest section suggested)."""
    if not isinstance(data, dict):
        raise UserError(
            f"{where}: expected a mapping with sections {', '.join(SECTIONS)}, got {type(data).__name__}"
        )
    for name in data:
        if name not in SECTIONS:
            hint = suggest(str(name), SECTIONS)
            fix = f"unknown section{hint}" if hint else f"unknown section; use {', '.join(SECTIONS)}"
            raise ConfigError(str(name), data[name], fix)
    return data


def plan_from_dict(data: dict, *, notes: list[str] | None = None, where: str = "") -> RunPlan:
    """Build and validate a RunPlan from a (possibly partial) nested dict; missing keys default.

    Keys of older zfctl versions are mapped to today's (zfctl/plan/legacy.py), one line each in
    ``notes`` (``where`` names the source in them).
    """
    check_sections(data)
    data = upgrade_fragment(data, where=where, notes=notes)
    sections = {name: section_from_dict(cls, data.get(name), name) for name, cls in SECTIONS.items()}
    return validate_plan(RunPlan(**sections))


def _yaml_lines(cls: type, values: dict, indent: str, comments: bool) -> list[str]:
    """One section's keys as YAML, each after its help text; a nested section (zenflow.tuning)
    as a block of its own one level deeper."""
    lines = []
    for f in fields(cls):
        if comments and f.metadata.get("help"):
            for wrapped in textwrap.wrap(f.metadata["help"], 100 - 2 * len(indent), break_on_hyphens=False):
                lines.append(f"{indent}# {wrapped}")
        tp = field_types(cls)[f.name][0]
        if isinstance(tp, type) and is_dataclass(tp):
            lines.append(f"{indent}{f.name}:")
            lines.extend(_yaml_lines(tp, values[f.name], indent + "  ", comments))
            continue
        chunk = yaml.safe_dump({f.name: values[f.name]}, sort_keys=False, default_flow_style=False, width=100)
        lines.extend(indent + ln for ln in chunk.rstrip("\n").splitlines())
    return lines


def plan_yaml_text(plan: RunPlan, *, comments: bool = True, header: str | None = None) -> str:
    """The plan as YAML; with `comments`, each key is preceded by its help text."""
    lines = [f"# {h}" for h in (header or "").splitlines()]
    data = plan_to_dict(plan)
    for name, cls in SECTIONS.items():
        lines.append(f"{name}:")
        lines.extend(_yaml_lines(cls, data[name], "  ", comments))
    return "\n".join(lines) + "\n"


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # os.open with 0o666 lets the umask decide the mode (mkstemp would force 0600 on plan.yaml).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is None:  # write() and fsync() errors carry no name: the one line names the file
            e.filename = str(path)
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump_plan_yaml(plan: RunPlan, path: Path | str, *, comments: bool = True) -> None:
    """Save the plan as self-documenting YAML (atomic write)."""
    from zfctl import __version__

    header = f"zfctl {__version__} run plan. `zfctl resume` reads this file back."
    atomic_write_text(Path(path), plan_yaml_text(plan, comments=comments, header=header))


def read_mapping(path: Path | str, what: str = "config file") -> dict:
    """Parse a YAML or JSON file into a dict; any problem is one UserError naming file and line."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path}: is a folder; give a YAML plan fragment or a DeepSpeed JSON file")
    if not path.is_file():
        raise UserError(f"{what} {path}: file not found")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is skipped
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{what} {path}: cannot read it ({e})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{what} {path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}"
            ) from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise UserError(f"{what} {path}: malformed YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{what} {path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_plan_yaml(path: Path | str, notes: list[str] | None = None) -> RunPlan:
    """Read a plan saved by `dump_plan_yaml` (or written by hand) and validate it; ``notes`` gets a
    line per key of an older zfctl that was mapped (zfctl/plan/legacy.py)."""
    return plan_from_dict(read_mapping(path, "plan file"), notes=notes, where=Path(path).name)
