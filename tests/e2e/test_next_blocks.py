"""Every line of every `next:` block runs as printed, also after an earlier block was followed.

The chain a new user walks: the demo's run (`make demo` is `zfctl finetune tiny-llama --data
alpaca-sample --output runs/demo`; here 2 steps, the fewest that still end in a checkpoint and a
block), then each line of its `next:` block, then each line of the block that the block's
`zfctl resume` prints. It found the second block's `zfctl export runs/demo --output runs/demo-hf`
refused (exit 2: the first block's export had made that folder): each export now writes a folder
named after its step (zfctl/cli/finetune.py, export_folder). The same runs show the step line's
legend once per run folder: above the first run's lines, not above a resume's (unless --verbose).

In-process (CliRunner), one run folder for the whole module: ~40 s on 2 busy cores, slow.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.train.display import STEP_LINE_LEGEND
from zfctl.train.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

# the demo's run, shortened: warm-ups within 2 steps so the step lines show ZenFlow's split
DEMO = ["finetune", "tiny-llama", "--data", "alpaca-sample", "--output", "runs/demo", "--max-steps", "2",
        "--set", "train.warmup_steps=4", "--set", "zenflow.full_warm_up_rounds=1"]


def zfctl(args: list[str]):
    """``zfctl ARGS`` in this process, as a 200-column pipe sees it."""
    return CliRunner().invoke(app, args, env={"COLUMNS": "200"})


def next_block(stdout: str) -> list[str]:
    """The commands of the `next:` block in ``stdout`` (its indented lines)."""
    lines = stdout.splitlines()
    block = []
    for line in lines[lines.index("next:") + 1:]:
        if not line.startswith("  "):
            break
        block.append(line.strip())
    return block


def follow(block: list[str]) -> dict[str, object]:
    """Run each line of a `next:` block as printed; {verb: its result}. A `source .../activate`
    line is checked to name an existing activate script (the rest runs in this environment)."""
    results = {}
    for command in block:
        words = shlex.split(command)
        if words[0] == "source":
            assert Path(words[1]).is_file(), command
            continue
        assert words[0] == "zfctl", command
        res = zfctl(words[1:])
        assert res.exit_code == 0, f"{command}\n{res.output}"
        results[words[1]] = res
    return results


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Iterator[tuple[Path, list]]:
    """(the work folder, [the demo's result, its block's results, the resume's block's results]).
    The CLI sets variables in os.environ (zfctl/quiet.py): restored afterwards, as is the cwd."""
    work = tmp_path_factory.mktemp("next-blocks")
    saved = dict(os.environ)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.delenv("ZFCTL_VERBOSE", raising=False)
        try:
            demo = zfctl(DEMO)
            assert demo.exit_code == 0, demo.output
            first = follow(next_block(demo.stdout))
            second = follow(next_block(first["resume"].stdout))
            yield work, [demo, first, second]
        finally:
            os.environ.clear()
            os.environ.update(saved)


def test_every_next_line_runs_as_printed_after_the_previous_block(chain) -> None:
    work, (demo, first, second) = chain
    blocks = [next_block(demo.stdout), next_block(first["resume"].stdout)]
    exports = [[c for c in block if c.startswith("zfctl export ")] for block in blocks]
    assert exports == [["zfctl export runs/demo --output runs/demo-hf-step2"],
                       ["zfctl export runs/demo --output runs/demo-hf-step4"]]
    # each block's export is its own step's; the first is still there, not replaced
    for step in (2, 4):
        assert (work / "runs" / f"demo-hf-step{step}" / "model.safetensors").is_file()
        assert f"(step {step}) -> runs/demo-hf-step{step}" in (first if step == 2 else second)["export"].stdout
    assert [r["step"] for r in read_metrics(work / "runs" / "demo" / "metrics.jsonl", "train")][-1] == 5
    assert set(first) == set(second) == {"generate", "export", "resume"}


def test_the_step_line_legend_is_printed_once_per_run_folder(chain) -> None:
    _, (demo, first, second) = chain
    assert demo.stdout.count(STEP_LINE_LEGEND) == 1
    assert demo.stdout.index(STEP_LINE_LEGEND) < demo.stdout.index("step 1/2 | loss")
    for resumed in (first["resume"], second["resume"]):
        assert "| loss " in resumed.stdout and STEP_LINE_LEGEND not in resumed.stdout, resumed.stdout
    verbose = zfctl(["resume", "runs/demo", "--max-steps", "6", "--allow-changes", "--verbose"])  # asked for
    assert verbose.exit_code == 0, verbose.output
    assert verbose.stdout.count(STEP_LINE_LEGEND) == 1
