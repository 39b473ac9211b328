"""Bad input at the edges (unreadable data files, absurd numbers, weak messages): each one line, exit 2, nothing written, or,
where the run may go on, one `warning:` line and no traceback.

`plan` and `finetune` run in-process (the Typer app); `finetune` refuses these in its pre-flight,
before the plan prints, so no model is built. Data files are written small, by hand.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import widen_consoles
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import UserError
from zfctl.plan.schema import DataConfig, ModelConfig
from zfctl.train.data import source as data_source
from zfctl.train.data.prepare import prepare_data
from zfctl.train.models import hub as model_hub
from zfctl.train.models.load import load_tokenizer

runner = CliRunner()
GOOD = {"instruction": "Say hi.", "output": "hi"}


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch)


def zf(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def empty_parquet(tmp: Path) -> Path:
    p = tmp / "empty.parquet"
    pq.write_table(pa.table({"instruction": pa.array([], pa.string()), "output": pa.array([], pa.string())}), p)
    return p


def fake_parquet(tmp: Path) -> Path:
    p = tmp / "fake.parquet"
    p.write_text("instruction,output\na,b\n")
    return p


def bad_utf8(tmp: Path) -> Path:
    p = tmp / "latin1.jsonl"
    p.write_bytes('{"instruction": "caf\u00e9", "output": "x"}\n'.encode("latin-1"))
    return p


def empty_jsonl(tmp: Path) -> Path:
    p = tmp / "empty.jsonl"
    p.write_text("")
    return p


def a_folder(tmp: Path) -> Path:
    p = tmp / "data.jsonl"
    p.mkdir()
    return p


# (what, --data file maker, the text the one error line must hold)
BAD_DATA = [
    ("parquet with 0 rows", empty_parquet, "empty.parquet: holds no records"),
    ("empty jsonl", empty_jsonl, "empty.jsonl: holds no records"),
    ("not parquet", fake_parquet, "fake.parquet: not a readable parquet file"),
    ("not UTF-8", bad_utf8, "latin1.jsonl: not UTF-8 text"),
    ("a folder", a_folder, "data.jsonl': is a folder; give one of the .json/.jsonl/.csv/.parquet files in it"),
    ("instruction null", lambda t: jsonl(t / "null.jsonl", [{"instruction": None, "output": "x"}]),
     "record 1: field 'instruction' is null; give it a text"),
    ("messages a string", lambda t: jsonl(t / "str.jsonl", [{"messages": "hello"}]),
     "record 1: field 'messages' must be a list of turns, got str"),
    ("two user turns", lambda t: jsonl(t / "two.jsonl", [{"messages": [
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}]),
     "record 1: field 'messages[1].role' is 'user' again, right after messages[0]: turns must alternate"),
]


@pytest.mark.parametrize("what, make, needle", BAD_DATA, ids=[b[0] for b in BAD_DATA])
def test_bad_data_is_one_line_exit_2_before_the_plan(tmp_path: Path, what: str, make, needle: str) -> None:
    data = make(tmp_path)
    for verb in ("plan", "finetune"):
        result = zf(verb, "tiny-llama", "--data", data, "--output", tmp_path / "run")
        assert result.exit_code == 2, (verb, result.output)
        lines = result.stderr.strip().splitlines()
        errors = [ln for ln in lines if ln.startswith("error: ")]
        assert len(errors) == 1 and needle in errors[0], (verb, result.stderr)
        assert all(ln.startswith(("error: ", "note: ")) for ln in lines), result.stderr  # a guessed template's note
        assert "run plan" not in result.stdout and "Traceback" not in result.output, (verb, result.output)
    assert not (tmp_path / "run").exists()


# (what, extra args after `VERB tiny-llama --data alpaca-sample`, the text of the error line)
BAD_FLAGS = [
    ("epochs 1e30", ["--set", "train.epochs=1e30"], "train.epochs='1e30': expected an integer"),
    ("empty --output", ["--output", ""], "--output '': the run folder is empty"),
    ("two --config", ["--config", "a.yaml", "--config", "b.yaml"], "--config was given 2 times (a.yaml, b.yaml)"),
    ("--output a file", ["--output", "afile"], "afile exists and is not a folder; choose another --output"),
    ("--config a folder", ["--config", "adir"], "config file adir: is a folder; give a YAML plan fragment"),
]


@pytest.mark.parametrize("what, extra, needle", BAD_FLAGS, ids=[b[0] for b in BAD_FLAGS])
def test_bad_flags_are_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str, extra: list,
                                       needle: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yaml").write_text("train: {lr: 1.0e-4}\n")
    (tmp_path / "b.yaml").write_text("train: {lr: 2.0e-4}\n")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    for verb in ("plan", "finetune"):
        result = zf(verb, "tiny-llama", "--data", "alpaca-sample", *extra)
        assert result.exit_code == 2, (verb, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (verb, result.stderr)
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, not in "." either


def test_a_single_config_with_a_bom_still_layers_over_the_presets(tmp_path: Path) -> None:
    (tmp_path / "b.yaml").write_bytes(b"\xef\xbb\xbftrain: {lr: 2.0e-4}\n")  # with a byte-order mark
    result = zf("plan", "tiny-llama", "--data", "alpaca-sample", "--config", tmp_path / "b.yaml", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["train"]["lr"] == 2e-4


def test_bare_zfctl_prints_the_help_and_no_empty_error() -> None:
    for args in ([], ["presets"]):
        result = zf(*args)
        assert result.exit_code == 0, result.output
        assert "error" not in result.output and "Usage" in result.output


def test_a_byte_order_mark_is_read_not_refused(tmp_path: Path) -> None:
    rows = "".join(json.dumps({**GOOD, "output": f"hi {i}"}) + "\n" for i in range(6))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + rows.encode())
    csv_bom = tmp_path / "bom.csv"
    csv_bom.write_bytes(b"\xef\xbb\xbfinstruction,output\nSay hi.,hi\n")
    assert data_source.read_file(bom).records[0] == {**GOOD, "output": "hi 0"}
    assert data_source.first_record(bom) == {**GOOD, "output": "hi 0"}
    assert data_source.read_file(csv_bom).records == [GOOD]  # the header's first name has no BOM in it
    result = zf("plan", "tiny-llama", "--data", bom, "--json", "--set", "train.micro_batch_size=4")  # 6 records
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["data"]["template"] == "alpaca"  # guessed through the BOM


def test_an_offline_hub_dataset_not_in_the_cache_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def not_cached(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/data' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(model_hub, "hub_offline_requested", lambda: True)
    monkeypatch.setattr(datasets, "load_dataset", not_cached)
    with pytest.raises(UserError) as e:
        data_source.read_hub("org/data", None, "train")
    msg = str(e.value)
    assert msg.startswith("hub dataset org/data split 'train': cannot be loaded: Couldn't reach")
    assert "HF_HUB_OFFLINE=1 allows only datasets already in the HF cache" in msg and "alpaca-sample" in msg


def test_an_unwritable_data_cache_is_one_warning_line_not_a_python_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from zfctl.plan import resolve_plan
    from zfctl.train.inputs import load_inputs

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")  # the cache lies under a file: mkdir fails, as on a read-only disk
    data = jsonl(tmp_path / "d.jsonl", [{**GOOD, "output": f"hi {i}"} for i in range(8)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Python warning (with its source line) fails the test
        prepared = prepare_data(DataConfig(name="d", source="local", path=str(data)),
                                load_tokenizer(ModelConfig()), seed=0, cache_dir=blocker / "data")
    assert prepared.cache_path is None and len(prepared.train) > 0
    assert prepared.cache_warning is not None and "not-a-folder/data" in prepared.cache_warning

    monkeypatch.setenv("ZFCTL_CACHE_DIR", str(blocker))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_inputs(resolve_plan("tiny-llama", str(data)), rank=0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: the data cache was not written ("), err
    assert "ZFCTL_CACHE_DIR" in err[0]


def test_the_pipeline_reads_unreadable_files_as_the_preflight_does(tmp_path: Path) -> None:
    # read_file is what a run (and each torchrun rank) reads: the same one line, not datasets' traceback
    for make, needle in ((empty_parquet, "holds no records"), (fake_parquet, "not a readable parquet file")):
        path = make(tmp_path)
        with pytest.raises(UserError, match=needle):
            data_source.read_file(path)
