"""Resolve what the user typed into one validated RunPlan.

Layers, lowest first: model preset < data preset < zenflow preset < config file (YAML plan
fragment or DeepSpeed JSON) < `--set` overrides < dedicated CLI flags (`--output`, ...). Each
layer is a partial nested dict; they are deep-merged and the result goes through
`plan_from_dict` (unknown keys, types, ranges). Filesystem checks (the data file exists, the
local model folder has a config.json) happen last, here, so that `plan_from_dict` stays usable
on a plan read back from a checkpoint on another machine.
"""

from __future__ import annotations

import csv
import json
import os
import re
from functools import reduce
from pathlib import Path

from zfctl.errors import ConfigError
from zfctl.plan.coerce import suggest
from zfctl.plan.deepspeed import from_deepspeed, looks_like_deepspeed
from zfctl.plan.fit import resolve_activation_checkpointing
from zfctl.plan.io import check_sections, plan_from_dict, read_mapping
from zfctl.plan.legacy import upgrade_fragment
from zfctl.plan.overrides import apply_overrides, deep_merge, parse_override
from zfctl.plan.precision import resolve_for_this_machine
from zfctl.plan.presets import find_preset, get_preset, list_presets
from zfctl.plan.schema import RunPlan
from zfctl.resources import presets_root

DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
_JSON_SNIFF_LIMIT = 64 << 20  # a .json list must be parsed whole: only peek into small ones
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _with_description(fragment: dict, section: str, name: str, description: str) -> dict:
    sec = dict(fragment.get(section) or {})
    sec.setdefault("name", name)
    if description:
        sec.setdefault("description", description)
    return {**fragment, section: sec}


def model_fragment(model: str) -> dict:
    """A model preset, a local save_pretrained folder, or a hub id `org/name`."""
    preset = find_preset("model", model)
    if preset is not None:
        return _with_description(preset.load(), "model", model, preset.description)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                "MODEL",
                model,
                "this folder has no config.json; give a save_pretrained folder (e.g. from `zfctl export`)",
            )
        local = str(path.resolve())
        return {"model": {"name": path.name, "source": "local", "hub_id": local, "tokenizer": local}}
    if _HUB_ID.match(model):
        return {"model": {"name": model, "source": "hub", "hub_id": model, "tokenizer": model}}
    names = [p.name for p in list_presets("model")]
    raise ConfigError(
        "MODEL",
        model,
        f"not a model preset{suggest(model, names)}, local folder or hub id "
        f"(org/name); presets: {', '.join(names)}",
    )


def first_record(path: Path) -> object | None:
    """The first record of a local .jsonl/.csv file (or of a .json list under 64 MiB: it is parsed
    whole); None when there is none or it is not cheap to read. An unreadable or malformed file is
    None too: the data pipeline reports it, naming the record. Read by the template guess below
    and by the pre-flight check of ``zfctl finetune`` (zfctl/train/preflight.py)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":  # utf-8-sig: a byte-order mark (Windows editors write one) is skipped
            with open(path, encoding="utf-8-sig") as f:
                line = next((ln for ln in f if ln.strip()), None)
            return None if line is None else json.loads(line)
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8-sig") as f:
                return next(csv.DictReader(f), None)
        if suffix == ".json" and path.stat().st_size < _JSON_SNIFF_LIMIT:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
            return data[0] if isinstance(data, list) and data else None
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return None


def _sniff_template(path: Path) -> dict:
    """Guess the template from the first record's fields; {} when unsure (defaults apply).

    ``messages`` / ``conversations`` (a list of turns) mean chat, ``instruction`` + ``output``
    alpaca, ``prompt`` + ``completion`` prompt_completion, ``text`` plain text.
    """
    first = first_record(path)
    if not isinstance(first, dict):
        return {}
    if any(first.get(f) is not None for f in ("messages", "conversations")):
        return {"template": "chat"}  # a malformed conversation is then named by the chat checks
    if "instruction" in first and "output" in first:
        return {"template": "alpaca"}
    if "prompt" in first and "completion" in first:
        return {"template": "prompt_completion"}
    if "text" in first:
        return {"template": "text", "text_field": "text"}
    return {}


def data_fragment(data: str, notes: list[str] | None = None) -> dict:
    """A data preset, a local .json/.jsonl/.csv/.parquet file, or a hub dataset id.

    For a local file the template is guessed from its first record; ``notes`` gets a line saying
    which one and why.
    """
    preset = find_preset("data", data)
    if preset is not None:
        return _with_description(preset.load(), "data", data, preset.description)
    path = Path(data).expanduser()
    if path.is_dir():
        raise ConfigError("--data", data, "is a folder; give one of the .json/.jsonl/.csv/.parquet files in it "
                          "or a data preset (`zfctl presets ls`)")
    if path.suffix.lower() in DATA_SUFFIXES:
        if not path.is_file():
            raise ConfigError(
                "--data",
                data,
                "file not found; give an existing .json/.jsonl/.csv/.parquet "
                "file or a data preset (`zfctl presets ls`)",
            )
        sniffed = _sniff_template(path)
        if sniffed and notes is not None:
            notes.append(f"data.template={sniffed['template']}: guessed from the fields of the first record of "
                         f"{path.name}; --set data.template=... to choose another")
        frag = {"name": path.stem, "source": "local", "path": str(path.resolve()), **sniffed}
        return {"data": frag}
    if _HUB_ID.match(data) and not path.exists():
        return {"data": {"name": data, "source": "hub", "path": data}}
    names = [p.name for p in list_presets("data")]
    raise ConfigError(
        "--data",
        data,
        f"not a data preset{suggest(data, names)}, a local "
        f"{'/'.join(DATA_SUFFIXES)} file or a hub id; presets: {', '.join(names)}",
    )


def config_fragment(path: Path, notes: list[str] | None) -> dict:
    """A YAML/JSON plan fragment, or a DeepSpeed JSON mapped onto one."""
    data = read_mapping(path, "config file")
    if path.suffix.lower() == ".json" and looks_like_deepspeed(data):
        imported = from_deepspeed(data)
        if notes is not None:
            notes.extend(imported.notes)
        return imported.fragment
    data = dict(data)
    data.pop("description", None)  # a file copied with `zfctl presets cp` keeps its description line
    return check_sections(data, f"config file {path}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text.rsplit("/", 1)[-1]).strip("-") or "run"


def _default_output_dir(merged: dict, model: str, data: str) -> dict:
    """runs/<model>-<data> unless some layer chose checkpoint.output_dir."""
    ckpt = merged.get("checkpoint")
    if ckpt is not None and not isinstance(ckpt, dict):
        return merged  # plan_from_dict reports the malformed section
    if ckpt and "output_dir" in ckpt:
        return merged

    def name(section: str, fallback: str) -> str:
        sec = merged.get(section)
        return str(sec.get("name", fallback)) if isinstance(sec, dict) else fallback

    out_dir = f"runs/{_slug(name('model', model))}-{_slug(name('data', data))}"
    return {**merged, "checkpoint": {**(ckpt or {}), "output_dir": out_dir}}


def check_paths(plan: RunPlan) -> None:
    """Filesystem checks for what the plan will read: fail now rather than after model load."""
    d = plan.data
    if d.source == "local" and not Path(d.path or "").expanduser().exists():
        raise ConfigError("data.path", d.path, "file not found; give an existing local data file")
    if d.source == "sample" and not (presets_root() / "samples" / str(d.path)).is_dir():
        raise ConfigError(
            "data.path", d.path, f"no shipped sample of that name under {presets_root() / 'samples'}"
        )
    m = plan.model
    if m.source == "local" and not (Path(m.hub_id or "").expanduser() / "config.json").is_file():
        raise ConfigError("model.hub_id", m.hub_id, "no config.json there; give a save_pretrained folder")


def _apply_sets(base: dict, overrides: list[str] | tuple[str, ...], notes: list[str] | None) -> dict:
    """`--set` over ``base``. The zenflow ones form one layer, mapped from older zfctl keys as a
    whole (legacy.py: `--set zenflow.select_strategy=epoch --set zenflow.select_interval=2` is one
    old pair); the rest apply in order, as `apply_overrides` does."""
    zen = [text for text in overrides if "zenflow" in parse_override(text)]
    merged = apply_overrides(base, [text for text in overrides if text not in zen])
    if not zen:
        return merged
    layer = upgrade_fragment(apply_overrides({}, zen), below=merged, where="--set", notes=notes)
    return deep_merge(merged, layer)


def resolve_plan(
    model: str,
    data: str,
    *,
    zenflow: str | None = None,
    config: Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    flags: dict | None = None,
    notes: list[str] | None = None,
) -> RunPlan:
    """Presets + config file + overrides -> a validated RunPlan (ConfigError/UserError on bad input).

    `flags` is a nested fragment from dedicated CLI options (applied last); `notes` collects
    informational lines (DeepSpeed keys that were ignored, what `train.precision: auto` chose
    and why) for the caller to print.
    """
    guessed: list[str] = []
    layers = [model_fragment(model), data_fragment(data, guessed),
              get_preset("zenflow", zenflow or "default").load()]
    merged: dict = reduce(deep_merge, layers, {})
    if config is not None:
        fragment = upgrade_fragment(config_fragment(Path(config), notes), below=merged, where=f"--config {config}",
                                    notes=notes)
        merged = deep_merge(merged, fragment)
    merged = _apply_sets(merged, overrides, notes)
    if flags:
        merged = deep_merge(merged, flags)
    plan = plan_from_dict(_default_output_dir(merged, model, data))
    check_paths(plan)
    if notes is not None:  # the guess, unless a later layer chose another template
        notes.extend(n for n in guessed if n.startswith(f"data.template={plan.data.template}:"))
    if plan.train.precision == "auto":
        # Resolved here, once: plan.yaml and checkpoints store the concrete dtype (see precision.py).
        choice = resolve_for_this_machine(plan.train.precision, plan.train.device)
        plan.train.precision = choice.precision
        if notes is not None:
            notes.append(choice.reason)
    # Resolved here too, once, against the plan's target machine: plan.yaml stores true or false.
    resolve_activation_checkpointing(plan, notes=notes)
    one_process_strategy(plan, notes)
    return plan


def one_process_strategy(plan: RunPlan, notes: list[str] | None) -> None:
    """``distributed.strategy: fsdp`` for a job of one process trains as zero2 (no group to shard
    over: zfctl/train/fsdp.py ``resolve_strategy``), so the plan says zero2, with a note: the
    printed plan and plan.yaml are the run that trains, as its checkpoints record it. The job's
    size is torchrun's WORLD_SIZE under torchrun (a job started by hand sets no distributed.nproc),
    else distributed.nproc x distributed.nodes."""
    d = plan.distributed
    world = int(os.environ.get("WORLD_SIZE") or 0) or d.nproc * d.nodes
    if d.strategy != "fsdp" or world != 1:
        return
    d.strategy = "zero2"
    if notes is not None:
        notes.append("distributed.strategy=fsdp on one process: nothing to shard over, so the run is zero2 (the "
                     "plan says so); --nproc N (N > 1) shards the model under fsdp")
