"""The figures the README quotes from the program, regenerated from it and checked against it.

    python scripts/readme_figures.py            # check: exit 1 with a diff for each quote that drifted
    python scripts/readme_figures.py --write    # rewrite the quotes (`make readme-figures`)

Hand-typed figures drifted as the program changed (a no-fit example, a memory table row,
a plan without its newest line, a step count). So every quote of program output is made by the
program here, and tests/cli/test_readme_figures.py fails when README.md no longer matches. After a
change that moves a figure (a new memory line, another step count), `make readme-figures` rewrites
them and the diff shows what moved. Two kinds of quote:

* blocks: README.md or a page under docs/ (``BLOCK_FILES``) holds ``<!-- figures: NAME -->`` ...
  ``<!-- /figures -->``, each name once; what lies between is exactly ``BLOCKS[NAME]()``: a
  command's output (`zfctl plan` runs as a subprocess, as a user runs it), a table built from
  `zfctl plan --json` or from the presets and the memory estimate, the lines `make demo` prints at
  its end;
* facts: a figure inside a sentence, found by a pattern with one group (``FACTS``), whose text
  must equal what the program gives (the demo's step count, in README.md and the tiny-llama preset;
  the memory figures of the README, the presets' comments and `make smollm2`'s suggested run).

Memory figures quoted in prose come from the same estimate the plan prints: bytes per parameter
from zfctl/cli/doctor.py ``host_bytes_per_param`` (what `zfctl doctor` prints), the SmolLM2 run's
RAM from scripts/demo.py ``smollm2_memory`` (what `make demo` prints) on ``CPU_MACHINE``.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BLOCK_FILES = [README, DOCS / "memory.md"]
START = re.compile(r"^<!-- figures: ([\w-]+) -->\n", re.MULTILINE)
END = "<!-- /figures -->\n"


# ----------------------------------------------------------------------------------- the program
def zfctl(*args: str, ok: tuple[int, ...] = (0,)) -> str:
    """stdout of ``zfctl ARGS`` run as a user runs it: its own process, this checkout, output to a
    pipe 250 columns wide (no wrapped table row), in an empty folder."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250"}
    env.pop("ZFCTL_VERBOSE", None)
    with tempfile.TemporaryDirectory() as cwd:
        p = subprocess.run([sys.executable, "-m", "zfctl", *args], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=600, check=False)
    if p.returncode not in ok:
        raise SystemExit(f"zfctl {' '.join(args)}: exit {p.returncode}\n{p.stderr}")
    return p.stdout


def unboxed(lines: list[str]) -> list[str]:
    """rich's memory table as plain columns: its borders and header dropped, each row's cells
    aligned as the README shows them (where, what, size, how)."""
    out = []
    for line in lines:
        if line[:1] in "┏┡└┃":  # top border, header rule, bottom border, header row
            continue
        if line.startswith("│"):
            where, what, size, how = (c.strip() for c in line.strip("│").split("│"))
            out.append(f"{where:<7} {what:<24} {size:>8}  {how}".rstrip())
        else:
            out.append(line)
    return out


PLAN_7B = ("llama2-7b", "--data", "alpaca", "--gpu-memory", "48GB", "--host-memory", "128GB")
NO_FIT = ("llama3.2-1b", "--data", "alpaca", "--set", "data.max_length=4096", "--set", "train.micro_batch_size=4",
          "--set", "train.activation_checkpointing=false", "--gpu-memory", "40GB", "--host-memory", "256GB")


def plan_lead(out: list[str]) -> list[str]:
    """What `zfctl plan` prints before the plan: the verdict, the totals, the machine, the advice
    (its `note:` lines left out: the README quotes the answer, docs/memory.md explains the autos)."""
    lead = out[:next(i for i, line in enumerate(out) if line.startswith("run plan"))]
    return [line for line in lead if not line.startswith("note: ")]


def block_plan_7b() -> str:
    out = zfctl("plan", *PLAN_7B).splitlines()
    first = next(i for i, line in enumerate(out) if line.startswith("memory estimate"))
    body = unboxed(out[first + 1:])
    return ("```\n$ zfctl plan " + " ".join(PLAN_7B) + "\n" + "\n".join(plan_lead(out)) + "\n...\n"
            + "\n".join(body) + "\n```\n")


def block_no_fit() -> str:
    out = zfctl("plan", *NO_FIT, ok=(3,)).splitlines()
    cmd = "$ zfctl plan " + " ".join(NO_FIT[:7]) + " \\\n    " + " ".join(NO_FIT[7:])
    return "```\n" + cmd + "\n" + "\n".join(plan_lead(out)) + "\n...\n```\n"


@functools.cache
def plan_json(gpu: str, host: str = "128GB") -> dict:
    return json.loads(zfctl("plan", "llama2-7b", "--data", "alpaca", "--gpu-memory", gpu, "--host-memory", host,
                            "--json", ok=(0, 3)))


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def memory_row(gpu: str) -> str:
    """One row of the Memory section's table: the 7B plan on a GPU of ``gpu`` with a 128 GB host."""
    d = plan_json(gpu)
    m, plan = d["memory"], d["plan"]
    how = f"`grad_layout` resolves to `{m['grad_layout']}`" if m["accumulate"] == "host" else "`accumulate: device`"
    if plan["train"]["activation_checkpointing"]:
        how += "; activation checkpointing on"
    short = " ".join(m["reasons"])
    host, dev = m["host_total"], m["device_total"]
    host_cell = f"{_gb(host)} ({host / m['size']['params']:.1f} B/param)"
    host_cell += " (does not fit 128 GB)" if "host" in short else ""
    dev_cell = _gb(dev) + (f" (does not fit {gpu.removesuffix('GB')} GB)" if "device memory" in short else "")
    if m["fits"]:
        host_cell = f"**{host_cell}**"
    return f"| one {gpu.removesuffix('GB')} GB GPU ({how}) | {host_cell} | {dev_cell} |"


def block_memory_7b() -> str:
    return ("| Llama-2-7B, bf16, 1 x 512 tokens, `default` preset, 128 GB host | host | device |\n"
            "| --- | ---: | ---: |\n" + memory_row("80GB") + "\n" + memory_row("48GB") + "\n" + memory_row("24GB") + "\n")


def block_memory_layouts() -> str:
    """The Memory section's table: host bytes per parameter of Llama-2-7B on 48 GB + 128 GB under
    each gradient layout (zfctl/cli/doctor.py ``host_bytes_per_param``, zfctl/plan/layouts.py)."""
    from zfctl.cli.doctor import REFERENCE_MACHINE, host_bytes_per_param
    from zfctl.plan import resolve_plan
    from zfctl.plan.layouts import ORDER, bytes_per_element

    plan = resolve_plan("llama2-7b", "alpaca")
    per = host_bytes_per_param()
    gpu, host = REFERENCE_MACHINE
    rows = []
    for lay in ORDER:
        where = " (+ 4 B on the GPU)" if lay.accumulate == "device" else ""
        rows.append(f"| {lay.words()} | {bytes_per_element(plan, lay)} B{where} | {per[lay.words()]:.1f} B |")
    return (f"| gradient layout (fastest first) | gradient, per host element per interval | host total per parameter, "
            f"Llama-2-7B on {gpu} + {host} |\n| --- | ---: | ---: |\n" + "\n".join(rows) + "\n")


# What each model preset's row of the README's presets table (and the memory line of its file's
# opening comment) is planned on: (data, GPU, host RAM per node, extra --set); GPU None = a CPU run.
# A preset missing here stops the script: every preset `zfctl presets ls` lists has a row.
PRESET_MACHINES: dict[str, tuple[str, str | None, str, tuple[str, ...]]] = {
    "tiny-llama": ("alpaca-sample", None, "32GB", ()),
    "smollm2-135m": ("alpaca-sample", None, "32GB", ()),
    "gpt2": ("arxiv-abstract", "24GB", "64GB", ()),
    "opt-350m": ("glue-sst2", "24GB", "64GB", ()),
    "llama3.2-1b": ("alpaca", "16GB", "64GB", ()),
    "llama2-7b": ("alpaca", "80GB", "128GB", ()),
    "llama2-13b": ("alpaca", "80GB", "512GB", ()),
    "llama2-70b": ("alpaca", "80GB", "1000GB", ("distributed.nproc=8", "distributed.nodes=2")),
}
CPU_MACHINE = "32GB"  # the host the README's CPU figures (SmolLM2's RAM) are planned for
PRESET_MEMORY = re.compile(r"^# Memory, as `zfctl plan` counts it (.+)$", re.MULTILINE)


@functools.cache
def preset_memory(name: str) -> tuple[str, str, str]:
    """(what the plan is for, host, device) of model preset ``name``: `zfctl plan`'s totals on its machine."""
    from zfctl.plan import resolve_plan
    from zfctl.plan.memory import estimate

    if name not in PRESET_MACHINES:
        raise SystemExit(f"model preset {name} has no machine in PRESET_MACHINES (scripts/readme_figures.py)")
    data, gpu, host, sets = PRESET_MACHINES[name]
    # as `zfctl plan NAME --data DATA --gpu-memory GPU --host-memory HOST --set ...` resolves it (the
    # machine is in the plan before its auto values resolve); a CPU run with --set train.device=cpu
    machine = {"host_memory": host, **({"gpu_memory": gpu} if gpu else {})}
    plan = resolve_plan(name, data, overrides=[*sets, *([] if gpu else ["train.device=cpu"])],
                        flags={"machine": machine})
    est = estimate(plan)
    d = plan.distributed
    if gpu is None:
        on = f"{data}; CPU, {host.removesuffix('GB')} GB host"
        cells = f"{_gb(est.node_host_total)}, device side included", "-"
    elif d.nproc * d.nodes > 1:
        on = f"{data}; {d.nodes} nodes x {d.nproc} GPUs of {gpu.removesuffix('GB')} GB, {host.removesuffix('GB')} GB host each, {est.strategy}"
        cells = f"{_gb(est.node_host_total)} per node", f"{_gb(est.device_total)} per GPU"
    else:
        where = "the gradient sum on the GPU" if est.accumulate == "device" else f"grad_layout {est.grad_layout}"
        on = f"{data}; {gpu.removesuffix('GB')} GB GPU, {host.removesuffix('GB')} GB host, {where}"
        cells = _gb(est.host_total), _gb(est.device_total)
    return (on if est.fits else f"{on}: does not fit"), *cells


def preset_comment(name: str) -> str:
    """The memory line of a model preset file's opening comment (after `counts it `)."""
    on, host, device = preset_memory(name)
    return f"({on}): host {host}, device {device}"


def block_presets_models() -> str:
    """The README's model presets table: every preset `zfctl presets ls` lists, its description and
    the memory `zfctl plan` counts for it."""
    from zfctl.plan.presets import list_presets

    rows = ["| `{}` | {} | {} | {} | {} |".format(p.name, p.description, *preset_memory(p.name))
            for p in list_presets("model")]
    return ("| name | what | planned for (data; machine) | host | device |\n| --- | --- | --- | ---: | ---: |\n"
            + "\n".join(rows) + "\n")


def smollm2_ram() -> str:
    """The suggested SmolLM2 run's RAM on ``CPU_MACHINE`` (scripts/demo.py smollm2_memory), e.g. '10.1 GB'."""
    return _demo().smollm2_memory(CPU_MACHINE).removesuffix(" RAM")


def bytes_per_param(layout: str) -> str:
    """Llama-2-7B's host bytes per parameter under ``layout`` as `zfctl doctor` prints them, e.g. '16.5 B'."""
    from zfctl.cli.doctor import host_bytes_per_param

    return f"{host_bytes_per_param()[layout]:.1f} B"


def llama2_7b_params() -> float:
    from zfctl.plan import resolve_plan
    from zfctl.plan.memory import model_size

    size = model_size(resolve_plan("llama2-7b", "alpaca"))
    assert size is not None
    return float(size.params)


@functools.cache
def demo_steps() -> int:
    """How many steps `make demo` runs: one epoch of the shipped sample in the plan's batches, as
    the training loop counts them (zfctl/train/recipe.py, total_steps)."""
    from zfctl.plan import resolve_plan
    from zfctl.train.data.prepare import prepare_data
    from zfctl.train.data.sampler import ResumableSampler
    from zfctl.train.models.load import load_tokenizer

    plan = resolve_plan("tiny-llama", "alpaca-sample")
    t = plan.train
    data = prepare_data(plan.data, load_tokenizer(plan.model), seed=t.seed)
    per_epoch = ResumableSampler(len(data.train), t.micro_batch_size, seed=t.seed).batches_per_epoch()
    return max(1, t.epochs * per_epoch // t.gradient_accumulation_steps)


def block_demo_next() -> str:
    """The `next:` block `make demo` prints on a fresh clone (.venv not on PATH: the source line first)."""
    from zfctl.cli.finetune import next_commands
    from zfctl.plan import resolve_plan

    plan = resolve_plan("tiny-llama", "alpaca-sample", flags={"checkpoint": {"output_dir": "runs/demo"}})
    steps = demo_steps()
    # in an empty folder: a checkout's own runs/demo-hf-step* (the block followed) would move the name
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as cwd:
        os.chdir(cwd)  # (contextlib.chdir is Python 3.11+; pyproject allows 3.10)
        try:
            lines = [c for c in next_commands(plan, Path("runs/demo"), steps) if not c.startswith("source ")]
        finally:
            os.chdir(here)
    return "```\nnext:\n  source .venv/bin/activate\n" + "".join(f"  {c}\n" for c in lines) + "```\n"


def _demo():  # the scripts/demo.py module
    sys.path.insert(0, str(ROOT / "scripts"))
    import demo

    return demo


def block_demo_closing() -> str:
    """The lines `make demo` ends with, on a CPU machine of ``CPU_MACHINE`` without the smollm2 extra
    (scripts/demo.py)."""
    demo = _demo()
    installed = demo.smollm2_installed
    demo.smollm2_installed = lambda: False
    try:
        lines = demo.closing_lines(cpu_host=CPU_MACHINE)
    finally:
        demo.smollm2_installed = installed
    return "```\n" + "\n".join(lines).strip("\n") + "\n```\n"


BLOCKS: dict[str, Callable[[], str]] = {
    "demo-closing": block_demo_closing,
    "demo-next": block_demo_next,
    "plan-7b": block_plan_7b,
    "plan-no-fit": block_no_fit,
    "memory-7b": block_memory_7b,
    "memory-layouts": block_memory_layouts,
    "presets-models": block_presets_models,
}


@dataclass(frozen=True)
class Fact:
    """A figure in running text: every match of ``pattern``'s one group in ``file`` is ``value()``."""

    file: Path
    pattern: str
    value: Callable[[], str]


FACTS = [
    Fact(README, r"`finished: runs/demo ended at step (\d+)", lambda: str(demo_steps())),
    Fact(README, r"runs/demo/checkpoints/step-(\d+) \(step \d+\) -> runs/demo-hf", lambda: f"{demo_steps():06d}"),
    Fact(README, r"runs/demo/checkpoints/step-\d+ \(step (\d+)\) -> runs/demo-hf", lambda: str(demo_steps())),
    # the export folder the demo's next: block names (zfctl/cli/finetune.py, export_folder)
    Fact(README, r"runs/demo-hf-step(\d+)\b", lambda: str(demo_steps())),
    Fact(ROOT / "presets" / "models" / "tiny-llama.yaml", r"one-epoch demo \((\d+) steps\)", lambda: str(demo_steps())),
    Fact(README, r"needs\s+(\d[\d.]* GB)\s+of\s+RAM\s+on\s+a\s+CPU", smollm2_ram),
    Fact(README, r"(\d[\d.]* B)\s+with\s+the\s+fp32\s+carry", lambda: bytes_per_param("carry")),
    Fact(README, r"(\d[\d.]* B)\s+with\s+one\s+set\s+of\s+per-step\s+slots", lambda: bytes_per_param("slots, 1 set")),
    Fact(README, r"(\d[\d.]* B)\s+with\s+two\s+sets\b", lambda: bytes_per_param("slots, 2 sets")),
    Fact(README, r"16\s+bytes\s+of\s+fp32\s+state\s+per\s+parameter\s+\([^)]*\):\s+(\d+ GB)\s+for\s+Llama-2-7B",
         lambda: f"{16 * llama2_7b_params() / 1e9:.0f} GB"),
    Fact(README, r"holds\s+its\s+(\d[\d.]* GB)\s+of\s+bf16\s+weights", lambda: f"{2 * llama2_7b_params() / 1e9:.1f} GB"),
    *(Fact(ROOT / "presets" / "models" / f"{name}.yaml", PRESET_MEMORY.pattern,
           functools.partial(preset_comment, name)) for name in PRESET_MACHINES),
    Fact(ROOT / "Makefile", r'^\t@echo "  (zfctl finetune smollm2-135m [^"]*)"$', lambda: _demo().SMOLLM2_RUN),
]


# ----------------------------------------------------------------------------------- the files
def blocks_in(text: str) -> list[tuple[str, int, int]]:
    """(name, start, end) of each quoted block's body in ``text``."""
    found = []
    for m in START.finditer(text):
        end = text.index(END, m.end())
        found.append((m.group(1), m.end(), end))
    return found


def quoted(name: str) -> str:
    """The body of block ``name`` as it stands, in whichever of ``BLOCK_FILES`` holds it."""
    for path in BLOCK_FILES:
        text = path.read_text(encoding="utf-8")
        bodies = {n: text[a:b] for n, a, b in blocks_in(text)}
        if name in bodies:
            return bodies[name]
    raise SystemExit(f"no file holds `<!-- figures: {name} -->` (scripts/readme_figures.py)")


def block_names() -> dict[str, list[str]]:
    """{block name: the files (relative to the repository) that hold it}."""
    where: dict[str, list[str]] = {}
    for path in BLOCK_FILES:
        for name, _, _ in blocks_in(path.read_text(encoding="utf-8")):
            where.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return where


def _with_group(m: re.Match[str], value: str) -> str:
    """The match with its one group replaced by ``value``."""
    whole, at = m.group(0), m.start(0)
    return whole[: m.start(1) - at] + value + whole[m.end(1) - at:]


def regenerate() -> dict[Path, tuple[str, str]]:
    """{file: (its text now, the text with every quote regenerated)}."""
    files: dict[Path, str] = {}
    for path in {*BLOCK_FILES, *(f.file for f in FACTS)}:
        files[path] = path.read_text(encoding="utf-8")
    new = dict(files)
    where = block_names()
    unknown = sorted(set(where) - set(BLOCKS))
    missing = sorted(set(BLOCKS) - set(where))
    twice = sorted(name for name, paths in where.items() if len(paths) > 1)
    if unknown or missing or twice:
        raise SystemExit(f"figure blocks: unknown {unknown}, missing {missing}, in more than one place {twice} "
                         "(scripts/readme_figures.py)")
    for path in BLOCK_FILES:
        text = new[path]
        for name, start, end in reversed(blocks_in(text)):
            text = text[:start] + BLOCKS[name]() + text[end:]
        new[path] = text
    for fact in FACTS:
        pattern = re.compile(fact.pattern, re.MULTILINE)
        if not pattern.search(new[fact.file]):
            raise SystemExit(f"{fact.file.name}: no match for {fact.pattern!r} (scripts/readme_figures.py)")
        new[fact.file] = pattern.sub(functools.partial(_with_group, value=fact.value()), new[fact.file])
    return {path: (files[path], new[path]) for path in files}


def drift(result: dict[Path, tuple[str, str]]) -> str:
    """A unified diff of every quote that differs from the program's output ('' when none)."""
    out = []
    for path, (old, new) in sorted(result.items()):
        if old != new:
            rel = str(path.relative_to(ROOT))
            out += difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{rel} (now)",
                                        f"{rel} (the program)")
    return "".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the quotes instead of checking them")
    args = parser.parse_args()
    result = regenerate()
    if args.write:
        for path, (old, new) in result.items():
            if old != new:
                path.write_text(new, encoding="utf-8")
                print(f"rewrote {path.relative_to(ROOT)}")
        return 0
    diff = drift(result)
    if diff:
        print(diff + "\nthe figures of the README and docs/ drifted from the program: `make readme-figures` "
              "rewrites them")
        return 1
    print("the figures of the README and docs/ match the program")
    return 0


if __name__ == "__main__":
    sys.exit(main())
