"""The machines the plan says fit are the product's contract (docs/memory.md; README, "Memory").

Each row is `zfctl plan MODEL --data alpaca --gpu-memory G --host-memory H` with the defaults
only, run in-process through the Typer app (no torch, no network: `plan` sizes a hub model from
its preset, models.yaml ``params_b``/``arch``), and must exit 0 saying "it fits". A change that
makes a planned machine stop fitting fails here, naming the row. Plus: llama2-7b's host total on
48 GB + 128 GB is at most 16.5 B per parameter (master 4 + moments 8 + one fp32 sum 4, the
process baseline and small buffers), and on 24 GB + 128 GB `--fit` finds a plan at topk >= 0.05.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from zfctl.cli import app

ROWS = {  # id: the command line after `zfctl plan`
    "1b-16gb-37gb": ["llama3.2-1b", "--gpu-memory", "16GB", "--host-memory", "37GB"],
    "1b-16gb-37gb-fp16": ["llama3.2-1b", "--gpu-memory", "16GB", "--host-memory", "37GB",
                          "--set", "train.precision=fp16"],
    "7b-48gb-128gb": ["llama2-7b", "--gpu-memory", "48GB", "--host-memory", "128GB"],
    "7b-80gb-128gb": ["llama2-7b", "--gpu-memory", "80GB", "--host-memory", "128GB"],
    "7b-48gb-128gb-zero-offload": ["llama2-7b", "--gpu-memory", "48GB", "--host-memory", "128GB",
                                   "--zenflow", "zero-offload"],
    "7b-80gb-128gb-zero-offload": ["llama2-7b", "--gpu-memory", "80GB", "--host-memory", "128GB",
                                   "--zenflow", "zero-offload"],
    "13b-80gb-256gb": ["llama2-13b", "--gpu-memory", "80GB", "--host-memory", "256GB"],
    "70b-2x8-80gb-1tb-fsdp": ["llama2-70b", "--nodes", "2", "--gpus-per-node", "8", "--gpu-memory", "80GB",
                              "--host-memory", "1TB", "--set", "distributed.strategy=fsdp"],
}
P_7B = 6.738e9  # llama2-7b's parameters (models.yaml)


def plan_json(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["plan", *args, "--data", "alpaca", "--json"])
    return result.exit_code, json.loads(result.stdout) if result.stdout.startswith("{") else {}


@pytest.mark.parametrize("row", list(ROWS))
def test_the_planned_machines_fit_with_the_defaults(row: str) -> None:
    result = CliRunner().invoke(app, ["plan", *ROWS[row], "--data", "alpaca"])
    first = result.stdout.splitlines()[0] if result.stdout else result.output
    assert result.exit_code == 0 and first.startswith("it fits"), f"{row}: {first}"
    # and it resumes there: a resume inside an interval under slots holds a 4 B fp32 carry the
    # host must have to spare (layouts.py resume_fits); the note says when it does not
    assert "more than the" not in result.stdout, f"{row}: a resume inside an interval does not fit"


def test_llama2_7b_on_48gb_and_128gb_holds_at_most_16_5_bytes_per_parameter() -> None:
    code, out = plan_json(*ROWS["7b-48gb-128gb"])
    mem = out["memory"]
    assert code == 0 and mem["fits"] and mem["grad_layout"] == "carry"
    assert mem["host_total"] / P_7B <= 16.5, mem["host_total"] / P_7B
    assert out["plan"]["zenflow"]["tuning"]["grad_layout"] == "carry"  # what plan.yaml would record


def test_llama2_7b_on_24gb_and_128gb_fits_with_fit_at_topk_at_least_0_05() -> None:
    code, out = plan_json(*["llama2-7b", "--gpu-memory", "24GB", "--host-memory", "128GB"], "--fit")
    assert code == 0 and out["memory"]["fits"] and out["fit"]["fits"], out.get("fit")
    assert out["plan"]["zenflow"]["topk_ratio"] >= 0.05
