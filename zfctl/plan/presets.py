"""The shipped presets: partial plan dicts in `presets/{models,data,zenflow}/<name>.yaml`.

A preset file is a plan fragment (`model:`, `data:`, `train:`, `zenflow:` ... sections) plus one
optional top-level `description:` line for `zfctl presets ls`. Its opening comment gives the
command that runs it and the memory it needs; `zfctl presets cp` copies the file verbatim so the
comments travel with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zfctl.errors import ConfigError
from zfctl.plan.coerce import suggest
from zfctl.plan.io import check_sections, read_mapping
from zfctl.resources import presets_root

# Preset kind -> (folder under presets/, the CLI flag that names it)
KINDS: dict[str, tuple[str, str]] = {
    "model": ("models", "MODEL"),
    "data": ("data", "--data"),
    "zenflow": ("zenflow", "--zenflow"),
}


@dataclass(frozen=True)
class Preset:
    """One shipped preset file."""

    kind: str
    name: str
    path: Path

    def load(self) -> dict:
        """The plan fragment, without the `description` line (validated section names)."""
        data = dict(read_mapping(self.path, f"{self.kind} preset"))
        data.pop("description", None)
        return check_sections(data, f"{self.kind} preset {self.name}")

    @property
    def description(self) -> str:
        """The one-line `description:` of the file ('' if absent)."""
        return str(read_mapping(self.path, f"{self.kind} preset").get("description", ""))


def list_presets(kind: str) -> list[Preset]:
    """Every shipped preset of `kind` ('model', 'data' or 'zenflow'), sorted by name."""
    folder = presets_root() / KINDS[kind][0]
    return [Preset(kind, p.stem, p) for p in sorted(folder.glob("*.yaml"))]


def find_preset(kind: str, name: str) -> Preset | None:
    """The preset called `name`, or None."""
    path = presets_root() / KINDS[kind][0] / f"{name}.yaml"
    return Preset(kind, name, path) if path.is_file() else None


def get_preset(kind: str, name: str) -> Preset:
    """The preset called `name`; an unknown name is a ConfigError with the nearest suggestion."""
    preset = find_preset(kind, name)
    if preset is None:
        names = [p.name for p in list_presets(kind)]
        hint = suggest(name, names)
        raise ConfigError(
            KINDS[kind][1],
            name,
            f"unknown {kind} preset{hint}; choose one of {', '.join(names)} (`zfctl presets ls`)",
        )
    return preset


def find_any(name: str) -> list[Preset]:
    """All presets called `name` across kinds (for `zfctl presets show NAME`)."""
    return [p for kind in KINDS if (p := find_preset(kind, name)) is not None]
