"""Inputs that still surprised a new user (round four): each is one clear line and the right exit
code, with nothing written.

No test here trains. `generate`'s refusals of its input come before any model loads, so a bare
folder stands in for the run; `plan` and `finetune` refuse in their pre-flight, in-process. Two
cases need a process of their own: a closed stdin (``sys.stdin`` is None only in a process
started with fd 0 closed) and ``OMP_NUM_THREADS`` (libgomp reads it, and prints to fd 2, when
torch loads: the CLI entry must fix it before then).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import widen_consoles
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import UserError
from zfctl.plan.machine import GB
from zfctl.train.prompts import read_prompts

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch, 400)


def zf(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def one_error(result, needle: str, code: int = 2) -> str:
    """The refusal's one line on stderr (nothing else printed, no traceback), holding ``needle``."""
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert result.stdout == "" and "Traceback" not in result.output, result.output
    return lines[0]


def zfctl_process(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "zfctl", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300, check=False, **kw)


# -- generate --chat with stdin closed ------------------------------------------------------------


def test_chat_with_stdin_closed_is_one_line(tmp_path: Path) -> None:
    """`zfctl generate RUN --chat <&-`: Python sets sys.stdin to None; the check comes before the
    run is read, so any folder stands in for it."""
    p = zfctl_process("generate", str(tmp_path), "--chat", preexec_fn=lambda: os.close(0))
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [("error: --chat needs a terminal on stdin (stdin is closed); for piped or "
                                     "scripted input use --prompt TEXT or --prompts FILE")], p.stderr
    assert p.stdout == ""


# -- --prompts files: control bytes, .json ---------------------------------------------------------


def test_a_prompts_file_with_control_bytes_names_the_file_and_its_first_bad_line(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_bytes(b"What is 12 + 7?\n\tindented\tand tabbed\n\x00\x01\x02\x03\x1b[2J\x7f\nSay \x1b hi\n")
    one_error(zf("generate", tmp_path, "--prompts", f),
              f"--prompts {f}: line 3 holds the control character '\\x00': not a text file")
    f.write_bytes(b"ok\r\nclear \x1b[2J the screen\n")  # the first one alone: line 2
    with pytest.raises(UserError, match=r"line 2 holds the control character '\\x1b'"):
        read_prompts(f)
    f.write_bytes(b"a\tb\r\nc\n")  # tabs and line ends are text
    assert [(p.text, p.line) for p in read_prompts(f)] == [("a\tb", 1), ("c", 2)]
    j = tmp_path / "p.jsonl"  # escaped in JSON, a control character is still no prompt
    j.write_text('"ok"\n{"prompt": "\\u001b[2J"}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"line 2: \"prompt\" holds the control character '\\x1b'"):
        read_prompts(j)


def test_a_json_prompts_file_is_read_as_json(tmp_path: Path) -> None:
    """A .json file: an array of prompts (each numbered by its line), one prompt, or JSON lines."""
    f = tmp_path / "p.json"
    f.write_text('[\n  "What is 12 + 7?",\n\n  {"prompt": "Hi", "system": "Be brief."}\n]\n', encoding="utf-8")
    assert [(p.text, p.system, p.line) for p in read_prompts(f)] == [("What is 12 + 7?", None, 2),
                                                                     ("Hi", "Be brief.", 4)]
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n', encoding="utf-8")
    assert [(p.text, p.line) for p in read_prompts(f)] == [("a", 1), ("b", 2)]
    f.write_text('{\n  "prompt": "one, over lines"\n}\n', encoding="utf-8")
    assert [p.text for p in read_prompts(f)] == ["one, over lines"]


@pytest.mark.parametrize("text, needle", [
    ("What is 12 + 7?\n", ("line 1 is not valid JSON (Expecting value); write each prompt as a JSON string or "
                          '{"prompt": "..."}, in an array (a .json file) or one per line, or give a .txt file')),
    ('[\n  "a",\n  ', "not valid JSON (Expecting value at line 3, column 3)"),
    ('[\n  "a",\n  {"prompt": null}\n]', 'line 3: "prompt" is null'),
    ("[]", "holds no prompt (the array is empty)"),
    ('[["a"]]', 'line 1: expected a string or {"prompt": ...}, got list'),
])
def test_a_json_prompts_file_that_is_not_json_prompts_is_refused_with_the_hint(tmp_path: Path, text: str,
                                                                               needle: str) -> None:
    f = tmp_path / "p.json"
    f.write_text(text, encoding="utf-8")
    one_error(zf("generate", tmp_path, "--prompts", f), f"--prompts {f}: {needle}")


def test_generate_help_says_how_a_json_file_is_read() -> None:
    text = " ".join(zf("generate", "--help").stdout.replace("│", " ").split())
    assert "a .json file an array of them (or JSON lines)" in text, text


# -- train.sample_prompts longer than the model ---------------------------------------------------

LONG = " ".join(["word"] * 1100)  # 1,112 tokens in the alpaca format; tiny-llama's limit is 1,024
LONG_LINE = ("train.sample_prompts[1] ('word word word word word word word wo...', 5,499 characters): 1,112 "
             "tokens with the run's prompt format, the model's limit is 1,024; give a shorter prompt")


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_log():
    """What transformers logs (its own handler writes to the stderr it found at import, which the
    in-process runner does not capture): the records, from its root logger."""
    handler = Records()
    log = logging.getLogger("transformers")
    log.addHandler(handler)
    yield handler.messages
    log.removeHandler(handler)


def test_a_sample_prompt_longer_than_the_model_is_refused_before_the_plan(tmp_path: Path, transformers_log) -> None:
    """Refused by plan and by finetune in the pre-flight: no plan printed, no run folder, no
    transformers line. (Were it not refused, the run is one step without an evaluation.)"""
    prompts = f"train.sample_prompts=['What is 12 + 7?', '{LONG}']"
    one_error(zf("plan", "tiny-llama", "--data", "alpaca-sample", "--set", prompts), LONG_LINE)
    one_error(zf("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", tmp_path / "run", "--set", prompts,
                 "--max-steps", "1", "--set", "train.eval_every=0", "--set", "train.device=cpu"), LONG_LINE)
    assert not (tmp_path / "run").exists()
    assert not [m for m in transformers_log if "Token indices" in m], transformers_log


def test_the_run_refuses_a_sample_prompt_past_a_limit_only_its_loaded_model_says() -> None:
    """A hub model's limit may be known only once it is loaded: the run's check refuses the
    prompt then, with the same line, instead of answering its last tokens."""
    from zfctl.plan.resolve import resolve_plan
    from zfctl.train.samples import SamplePrompts

    plan = resolve_plan("tiny-llama", "alpaca-sample",
                        overrides=["train.sample_prompts=['Say hi.', 'a b c d e f g h i j']"])
    assert [len(ids) for ids in SamplePrompts(plan, model_config={"n_positions": 22}).ids] == [16, 21]  # whole
    with pytest.raises(UserError, match=re.escape("train.sample_prompts[1] ('a b c d e f g h i j', 19 characters): "
                                                  "21 tokens with the run's prompt format, the model's limit is 21;")):
        SamplePrompts(plan, model_config={"n_positions": 21})


# -- plan: no model fits; sizes that never read alike ---------------------------------------------


@pytest.mark.parametrize("args, code, first", [
    (["--host-memory", "300MB"], 3,
     ("no model fits: the process alone needs 0.45 GB of host RAM (Python, torch, transformers, the tokenizer and "
     "data, before any model), more than the host offers: 0.23 GB may be used of its 0.30 GB")),
    (["--gpu-memory", "80GB", "--host-memory", "1GB", "--fit"], 2,
     ("error: --fit: no model fits: the process alone needs 2.00 GB of host RAM (Python, torch, transformers, the "
     "tokenizer and data, CUDA libraries, before any model), more than the host offers: 0.75 GB may be used of its "
     "1.00 GB")),
    (["--gpu-memory", "80GB", "--host-memory", "4GB", "--set", "distributed.nproc=2"], 3,
     ("no model fits: the 2 processes alone need 4.00 GB of host RAM (Python, torch, transformers, the tokenizer and "
     "data, CUDA libraries, before any model), more than the host offers: 3.00 GB may be used of its 4.00 GB")),
])
def test_a_host_smaller_than_the_process_says_no_model_fits_first(args: list[str], code: int, first: str) -> None:
    """The only line: no advice to shrink the model, the micro-batch or topk (nothing would fit)."""
    result = zf("plan", "tiny-llama", "--data", "alpaca-sample", *args)
    assert result.exit_code == code, result.output
    assert result.output.strip().splitlines() == [first], result.output


def test_finetune_fit_on_a_host_smaller_than_the_process_says_no_model_fits(tmp_path: Path) -> None:
    one_error(zf("finetune", "tiny-llama", "--data", "alpaca-sample", "--output", tmp_path / "run", "--fit",
                 "--gpu-memory", "80GB", "--host-memory", "1GB"), "error: --fit: no model fits: the process alone")
    assert not (tmp_path / "run").exists()


def test_sizes_of_a_verdict_never_read_alike() -> None:
    from zfctl.plan.verdict import gb_apart

    assert gb_apart(1.15 * GB, 1.125 * GB, 1.5 * GB) == ["1.15 GB", "1.12 GB", "1.50 GB"]
    assert gb_apart(100 * GB, 85 * GB) == ["100.0 GB", "85.0 GB"]  # apart already: one decimal
    assert gb_apart(2 * GB, 2 * GB, 1 * GB) == ["2.0 GB", "2.0 GB", "1.0 GB"]  # the same size reads the same
    a, b = gb_apart(1.0 * GB + 2048, 1.0 * GB)
    assert a != b and float(a.split()[0]) > float(b.split()[0])


def test_the_verdict_says_why_its_need_is_not_the_tables_host_total() -> None:
    """update_interval auto on 1.1 GB without CUDA (its slots bounded by the host: the carry, and
    activation checkpointing on): needs 0.83 GB of 0.825 GB usable, which read "0.8 GB" twice;
    and the need is the host total plus the device total (the device side is host RAM without
    CUDA), so it is not the table's host total."""
    from zfctl.plan.memory import estimate
    from zfctl.plan.render import machine_line
    from zfctl.plan.resolve import resolve_plan
    from zfctl.plan.verdict import gb

    result = zf("plan", "tiny-llama", "--data", "alpaca-sample", "--set", "zenflow.update_interval=auto",
                "--host-memory", "1.1GB", "--json")
    assert result.exit_code == 3, result.output
    est = json.loads(result.stdout)["memory"]
    [reason] = est["reasons"]
    m = re.fullmatch(r"host RAM: needs (\S+) GB \(the host total (.+) \+ the device total (.+): without CUDA the "
                     r"device side is host RAM\), the machine has (\S+) GB of which (\S+) GB may be used \(largest: .*\)",
                     reason)
    assert m, reason
    need, host, device, ram, usable = m.groups()
    assert (host, device) == (gb(est["host_total"]), gb(est["device_total"]))  # as the table prints them
    assert need != usable and float(need) > float(usable), reason
    assert abs(float(need) - est["node_host_total"] / GB) <= 0.005 and float(ram) == 1.1
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=["zenflow.update_interval=auto",
                                                                  "machine.host_memory=1.1GB"])
    assert machine_line(estimate(plan)).startswith(f"checked against: {ram} GB RAM ({usable} GB usable)")


# -- OMP_NUM_THREADS that libgomp refuses ----------------------------------------------------------


@pytest.mark.parametrize("value, fine", [("", False), ("  ", False), ("abc", False), ("0", False), ("-1", False),
                                         ("2abc", False), ("4", True), (" 4 ", True), ("4,2", True)])
def test_a_bad_omp_num_threads_is_removed_for_this_process_and_its_children(value: str, fine: bool) -> None:
    """What libgomp accepts (tested against it: each refused value makes it print its line)."""
    from zfctl.cli._threads import drop_bad_omp_threads

    env = {"OMP_NUM_THREADS": value, "PATH": "/bin"}
    note = drop_bad_omp_threads(env)
    assert (note is None) == fine and ("OMP_NUM_THREADS" in env) == fine
    if not fine:  # the environment children inherit holds no value for libgomp to refuse
        assert note == (f"OMP_NUM_THREADS={value!r} is not a thread count (a positive integer); ignored, as if "
                        "unset: torch and the CPU AdamW use their default thread counts (zfctl doctor shows them)")


@pytest.mark.slow
def test_doctor_with_a_bad_omp_num_threads_prints_a_note_not_libgomps_line() -> None:
    """A process: libgomp prints when torch loads it. doctor loads torch and the native library."""
    p = zfctl_process("doctor", env={"OMP_NUM_THREADS": "abc"})
    assert p.returncode == 0, p.stderr
    assert "libgomp" not in p.stderr + p.stdout, p.stderr
    assert p.stderr.splitlines() == [("note: OMP_NUM_THREADS='abc' is not a thread count (a positive integer); ignored, "
                                     "as if unset: torch and the CPU AdamW use their default thread counts (zfctl "
                                     "doctor shows them)")], p.stderr
    row = next(line for line in p.stdout.splitlines() if line.startswith("│ threads "))
    assert re.search(r"│ warn +│ OMP_NUM_THREADS='abc' is not a thread count: ignored; torch uses \d+ intra-op "
                     r"threads, the CPU AdamW \d+ ", row), row


def test_doctor_names_the_omp_num_threads_value_and_the_counts_used(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from zfctl import _native
    from zfctl.cli import doctor

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert doctor.check_threads() == ("ok", (f"OMP_NUM_THREADS='3'; torch uses {torch.get_num_threads()} intra-op "
                                            f"threads, the CPU AdamW {_native.get_num_threads()}"))
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert doctor.check_threads()[1].startswith("OMP_NUM_THREADS unset; torch uses ")
