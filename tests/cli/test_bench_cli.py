"""`zfctl bench` through the real CLI and the real ZenFlow engine, on CPU, in seconds."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from zfctl.bench.report import CSV_COLUMNS
from zfctl.cli import app

runner = CliRunner()
WIDE = {"COLUMNS": "200"}  # rich wraps tables at 80 columns otherwise

HIDDEN, NLAYERS, TOPK = 64, 2, 0.25
# The synthetic model's matrices: NLAYERS x [HIDDEN, HIDDEN] fp32 weights (biases stay on the device).
MATRIX_BYTES = NLAYERS * HIDDEN * HIDDEN * 4


def invoke(*args: str):
    return runner.invoke(app, ["bench", *args], env=WIDE)


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """One 2-configuration grid (topk 0.25 x interval 2,4) plus the baselines, run once."""
    out = tmp_path_factory.mktemp("bench")
    res = invoke(
        "--hidden-dim",
        str(HIDDEN),
        "--nlayers",
        str(NLAYERS),
        "--dtype",
        "fp32",
        "--topk",
        str(TOPK),
        "--interval",
        "2,4",
        "--overlap",
        "on",
        "--warmup",
        "4",
        "--iterations",
        "2",
        "--device",
        "cpu",
        "--json",
        str(out / "b.json"),
        "--csv",
        str(out / "b.csv"),
    )
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "b.json").read_text())
    rows = list(csv.DictReader((out / "b.csv").open()))
    return res.output, doc, rows


def test_grid_runs_the_baselines_and_both_configurations(grid):
    output, doc, csv_rows = grid
    rows = doc["results"]
    assert [(r["name"], r["interval"]) for r in rows] == [
        ("zero-offload", 1),
        ("off", 1),
        ("zenflow", 2),
        ("zenflow", 4),
    ]
    for header in (
        "accumulation steps",
        "update steps",
        "all steps",
        "speedup",
        "stall",
        "forward",
        "backward",
        "device opt",
        "CPU step",
        "D2H",
        "H2D",
    ):
        assert header in output
    for r in rows:
        assert r["label"] in output
    # --iterations 2 x the longest interval (4): every configuration times 8 steps.
    assert [r["steps"] for r in rows] == [8, 8, 8, 8]
    # Update (boundary) steps: every step for zero-offload, none for off (nothing on the host),
    # one per interval for ZenFlow.
    assert [r["n_update"] for r in rows] == [8, 0, 4, 2]
    assert [r["n_accumulate"] for r in rows] == [0, 8, 4, 6]
    assert list(csv_rows[0]) == CSV_COLUMNS and len(csv_rows) == 4
    assert [float(c["overall_mean_ms"]) for c in csv_rows] == pytest.approx(
        [r["step_ms"]["overall"]["mean"] for r in rows]
    )
    assert doc["meta"]["n_params"] == NLAYERS * (HIDDEN * HIDDEN + HIDDEN)
    assert doc["meta"]["timing"] == "wall clock"


def test_numbers_are_positive_and_consistent(grid):
    _, doc, _ = grid
    for r in doc["results"]:
        s = r["step_ms"]
        for kind in ("accumulate", "update", "overall"):
            if s[kind]["n"]:
                assert s[kind]["mean"] > 0 and s[kind]["median"] > 0
            else:  # a kind this configuration does not have is absent, not a zero
                assert s[kind]["mean"] is None
        if s["accumulate"]["n"] and s["update"]["n"]:
            assert (
                s["accumulate"]["mean"] <= s["overall"]["mean"] <= s["update"]["mean"]
                or s["update"]["mean"] <= s["overall"]["mean"] <= s["accumulate"]["mean"]
            )
        steps = [rec["step_ms"] for rec in r["records"]]
        assert len(steps) == r["steps"] and sum(steps) / len(steps) == pytest.approx(s["overall"]["mean"])
        # The phases are cut out of the step by the same clock: they add up to it.
        for rec in r["records"]:
            assert rec["fwd_ms"] > 0 and rec["bwd_ms"] > 0 and rec["opt_ms"] > 0
            assert rec["fwd_ms"] + rec["bwd_ms"] + rec["opt_ms"] == pytest.approx(rec["step_ms"])
            assert 0 <= rec["stall_ms"] <= rec["opt_ms"]
        assert s["overall"]["mean"] <= r["wall_ms_per_step"]  # marks lie inside the timed window
        assert 0 <= r["stall_fraction"] < 1
        assert r["speedup_vs_zero_offload"] > 0
        if r["name"] != "off":  # a CPU update completed in every interval
            assert r["cpu_step_ms"]["n"] > 0 and r["cpu_step_ms"]["mean"] > 0
    assert doc["results"][0]["speedup_vs_zero_offload"] == 1.0


def test_bytes_match_the_layout(grid):
    """D2H: the engine streams slot-sized ranges of whole columns, device-owned columns riding
    along (zfctl/offload/device/chunks.py); one 32 MiB slot holds a whole 64x64 matrix, so every step
    moves all matrix gradients plus a few bytes of scalars (norm, clip coefficient). H2D: the
    host's new values of the matrices, once per interval (overlap installs the previous
    interval's update at each boundary). `off` keeps everything on the device: no traffic."""
    _, doc, _ = grid
    zo, off, u2, u4 = doc["results"]
    for r, interval in ((zo, 1), (u2, 2), (u4, 4)):
        for rec in r["records"]:
            assert 0 <= rec["d2h_bytes"] - MATRIX_BYTES <= 16
            assert rec["h2d_bytes"] == (MATRIX_BYTES if rec["update"] else 0)
        assert r["h2d_bytes_per_step"] == MATRIX_BYTES / interval
    assert off["d2h_bytes_per_step"] == 0 and off["h2d_bytes_per_step"] == 0
    assert all(r["comm_bytes_per_step"] == 0 for r in doc["results"])  # one process: no group traffic
    param_bytes = doc["meta"]["param_bytes"]
    assert zo["traffic_x_model"] == pytest.approx((zo["d2h_bytes_per_step"] + MATRIX_BYTES) / param_bytes)


def test_the_bound_and_its_gap_are_printed_and_in_the_json(grid):
    """Each row's bound (zfctl/bench/bound.py) from its steps' ledgers and the measured machine:
    on CPU, compute + host memory (one set of cores), no link; the gap split into its parts."""
    output, doc, csv_rows = grid
    for header in ("Bound per step", "x bound", "limit", "selection", "install", "boundary wait", "hook wait",
                   "other"):
        assert header in output
    meta = doc["meta"]
    assert meta["host_gbps"] > 0 and meta["host_threads"] >= 1 and meta["d2h_gbps"] is meta["h2d_gbps"] is None
    assert meta["bound_rule"].startswith("compute + host memory")
    for r, c in zip(doc["results"], csv_rows):
        b, recs = r["bound"], r["records"]
        assert b["measured_ms"] == r["step_ms"]["overall"]["mean"] and b["limit"] == "device + host"
        assert b["ratio"] == pytest.approx(b["measured_ms"] / b["bound_ms"])
        assert float(c["bound_ms"]) == pytest.approx(b["bound_ms"])
        host = sum(rec["host_bytes"] for rec in recs) / len(recs)
        assert b["bytes_per_step"]["host"] == pytest.approx(host)  # the ledgers of the timed steps
        assert b["terms_ms"]["host"] == pytest.approx(host / (meta["host_gbps"] * 1e6))
        assert b["bound_ms"] == pytest.approx(b["terms_ms"]["device"] + b["terms_ms"]["host"])
        assert b["gap_ms"]["selection"] == 0  # this grid's configurations select before the timed steps
        assert sum(b["gap_ms"].values()) == pytest.approx(b["measured_ms"] - b["bound_ms"])
        for rec in recs:  # every step's ledger adds up to its totals
            assert rec["d2h_bytes"] == sum(v for k, v in rec["bytes"].items() if k.startswith("d2h."))
    off = doc["results"][1]
    assert off["bound"]["bytes_per_step"] == {"d2h": 0, "h2d": 0, "host": 0} and off["bound"]["terms_ms"]["host"] == 0


@pytest.mark.slow
def test_preset_model_runs_with_tokens_per_second(tmp_path):
    out = tmp_path / "llama.json"
    res = invoke(
        "--model",
        "tiny-llama",
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--dtype",
        "fp32",
        "--topk",
        "0.1",
        "--interval",
        "1",
        "--warmup",
        "1",
        "--iterations",
        "2",
        "--device",
        "cpu",
        "--json",
        str(out),
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    v, h, i, layers = 4096, 256, 688, 4  # presets/models/tiny-llama.yaml, untied embeddings
    assert doc["meta"]["n_params"] == 2 * v * h + layers * (4 * h * h + 3 * h * i + 2 * h) + h
    assert [r["name"] for r in doc["results"]] == ["zero-offload", "off", "zenflow"]
    for r in doc["results"]:
        assert r["tokens_per_s"] == pytest.approx(32 * r["samples_per_s"] / 2)
        assert r["steps"] == 2 and r["step_ms"]["overall"]["mean"] > 0


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from zfctl.bench.plot import plot

    rows = [
        {
            "label": "zero-offload",
            "stall_fraction": 0.5,
            "step_ms": {"accumulate": {"mean": None}, "update": {"mean": 20.0}, "overall": {"mean": 20.0}},
        },
        {
            "label": "topk 0.1, U 4",
            "stall_fraction": 0.01,
            "step_ms": {"accumulate": {"mean": 5.0}, "update": {"mean": 9.0}, "overall": {"mean": 6.0}},
        },
    ]
    plot(rows, tmp_path / "p.png", {"model": "m", "device": "cpu"})
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--topk", "1.5"], "--topk 1.5"),
        (["--interval", "0"], "--interval 0"),
        (["--overlap", "maybe"], "--overlap 'maybe'"),
        (["--overlap", "on", "--no-overlap"], "--no-overlap"),
        (["--dtype", "fp8"], "--dtype 'fp8'"),
        (["--iterations", "0"], "--iterations 0"),
        (["--model", "tiny-lama"], "did you mean tiny-llama"),
        (["--model", "tiny-llama", "--hidden-dim", "64"], "--hidden-dim"),
        (["--seq-len", "64"], "--seq-len"),
        (["--json", "no/such/dir/b.json"], "does not exist"),
        (["--plot", "b.pdf"], "must end in .png"),
        (["--max-grad-norm", "0"], "--max-grad-norm"),
        (["--activation-checkpointing", "sometimes", "--model", "tiny-llama"],
         "--activation-checkpointing 'sometimes': use on, off or on,off"),
        (["--activation-checkpointing", "on"], "--activation-checkpointing on needs --model PRESET"),
        (["--zenflow", "fast"], "--zenflow 'fast': not a zenflow preset"),
        (["--set", "train.lr=1"], "--set train.lr=1: zfctl bench takes zenflow.* keys only"),
        (["--set", "zenflow.topk_ratio=0.2"], "sets zenflow.topk_ratio itself; use --topk"),
        (["--set", "zenflow.install_lagg=1"],
         "zenflow.install_lagg=1: unknown key (did you mean zenflow.tuning.install_lag?)"),
        (["--set", "zenflow.tuning.install_lag=-1"], "zenflow.tuning.install_lag=-1: must be an integer >= 0"),
        (["--set", "zenflow.tuning.pin_memory=false"], "sets zenflow.tuning.pin_memory itself; use --pin"),
        (["--set", "zenflow.pin_memory=false"], "sets zenflow.tuning.pin_memory itself; use --pin"),
        (["--set", "install_lag=1"], "use --set section.key=value"),
        (["--set", "zenflow.tuning={ring_slots: 8, pin_memory: false}"],
         "sets zenflow.tuning.pin_memory itself; use --pin"),  # every key of a mapping, not the first
        (["--zenflow", "default", "--interval", "4,16"],  # refused before the first point runs
         ("the grid point 'topk 0.1, U 16, overlap on, pin on': zenflow.select_interval=8: must be >= "
          "update_interval (16)")),
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_flag(args, needle):
    res = invoke(*args, "--device", "cpu")
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output


def test_existing_report_is_not_overwritten_without_force(tmp_path):
    target = tmp_path / "b.json"
    target.write_text("keep me")
    res = invoke("--json", str(target), "--device", "cpu")
    assert res.exit_code == 2 and "--force" in res.output
    assert target.read_text() == "keep me"


def test_plot_without_matplotlib_fails_before_running(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    res = invoke("--plot", str(tmp_path / "p.png"), "--device", "cpu")
    assert res.exit_code == 2
    assert "pip install 'zfctl[plot]'" in res.output
    assert "zfctl bench:" not in res.output  # nothing was run
    assert not (tmp_path / "p.png").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_time_the_step_and_agree_with_the_wall_clock(tmp_path):
    out = tmp_path / "gpu.json"
    res = invoke(
        "--hidden-dim",
        "1024",
        "--nlayers",
        "2",
        "--topk",
        "0.1",
        "--interval",
        "4",
        "--overlap",
        "on,off",
        "--warmup",
        "8",
        "--iterations",
        "4",
        "--device",
        "cuda",
        "--json",
        str(out),
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["meta"]["timing"] == "CUDA events"
    for r in doc["results"]:
        # Events measure the device timeline, the wall clock the host's; over a whole window
        # (one sync at its end) they agree to within the loop's own overhead.
        assert r["step_ms"]["overall"]["mean"] == pytest.approx(r["wall_ms_per_step"], rel=0.25)


def test_zenflow_preset_sets_the_keys_the_grid_does_not(tmp_path):
    """--zenflow PRESET: its selection and correction keys apply, the grid's four knobs still win."""
    res = invoke("--hidden-dim", "32", "--nlayers", "1", "--dtype", "fp32", "--topk", "0.25", "--interval", "2",
                 "--warmup", "2", "--iterations", "1", "--device", "cpu", "--zenflow", "paper",
                 "--json", str(tmp_path / "b.json"))
    assert res.exit_code == 0, res.output
    base = json.loads((tmp_path / "b.json").read_text())["meta"]["zenflow_base"]
    assert (base["select_interval"], base["deferred_lr_scale"]) == ("auto", "off")
    assert base["topk_ratio"] == 0.1  # the preset's, recorded as given; the grid ran topk 0.25


def test_set_changes_one_zenflow_key_for_every_configuration(tmp_path):
    """--set zenflow.tuning.install_lag=1: each overlapped CPU update lands one step after its
    boundary (its H2D bytes move there) instead of at the next boundary; the rest of the run is the
    same."""
    def zenflow_steps(*extra: str) -> tuple[dict, list[tuple[bool, int]]]:
        out = tmp_path / f"b{len(extra)}.json"
        res = invoke("--hidden-dim", "32", "--nlayers", "1", "--dtype", "fp32", "--topk", "0.25", "--interval", "4",
                     "--overlap", "on", "--warmup", "4", "--iterations", "2", "--device", "cpu", "--json", str(out),
                     *extra)
        assert res.exit_code == 0, res.output
        doc = json.loads(out.read_text())
        (row,) = [r for r in doc["results"] if r["name"] == "zenflow"]
        return doc["meta"]["zenflow_base"], [(r["update"], r["h2d_bytes"]) for r in row["records"]]

    base, lag0 = zenflow_steps()
    assert base["select_interval"] == "auto"  # no --zenflow: paper, the reference benchmark's algorithm
    base, lag1 = zenflow_steps("--set", "zenflow.tuning.install_lag=1")
    assert base["tuning"]["install_lag"] == 1 and base["deferred_lr_scale"] == "off"  # the preset's other keys stay
    install = 32 * 32 * 4  # an install's H2D bytes on this 32x32 fp32 model (the same with either lag)
    assert [u for u, _ in lag0] == [u for u, _ in lag1] == [False, False, False, True] * 2
    assert [b for _, b in lag0] == [0, 0, 0, install] * 2  # installed at the next boundary
    assert [b for _, b in lag1] == [install, 0, 0, 0] * 2  # one step after its boundary


def test_activation_checkpointing_on_and_off_side_by_side(tmp_path, monkeypatch):
    """--activation-checkpointing on,off: the grid once per setting, each with its own zero-offload
    baseline (the speedup compares like with like), labelled, in the CSV, and really recomputing."""
    from zfctl.bench import suite

    runs: list[int] = []
    recomputing = suite.recomputing

    def counting(build):
        inner = recomputing(build)

        def b(steps):
            m = inner(steps)
            mlp = m.module.model.layers[0].mlp
            forward = mlp.forward
            mlp.forward = lambda *a, **k: (runs.append(1), forward(*a, **k))[1]
            return m

        return b

    monkeypatch.setattr(suite, "recomputing", counting)
    res = invoke("--model", "tiny-llama", "--seq-len", "16", "--batch", "2", "--dtype", "fp32", "--topk", "0.1",
                 "--interval", "1", "--warmup", "1", "--iterations", "2", "--device", "cpu", "--baselines",
                 "zero-offload", "--activation-checkpointing", "on,off", "--csv", str(tmp_path / "b.csv"))
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader((tmp_path / "b.csv").open()))
    assert [(r["name"], r["recompute"]) for r in rows] == [
        ("zero-offload", "True"), ("zenflow", "True"), ("zero-offload", "False"), ("zenflow", "False")]
    assert rows[1]["label"].endswith(", recompute") and not rows[3]["label"].endswith(", recompute")
    for base, row in ((rows[0], rows[1]), (rows[2], rows[3])):  # each against its own baseline
        assert float(row["speedup_vs_zero_offload"]) == pytest.approx(
            float(base["overall_mean_ms"]) / float(row["overall_mean_ms"]), rel=1e-3)
    # The two recompute configurations, 1 warm-up + 2 timed steps each: the MLP forward twice per step.
    assert len(runs) == 2 * 3 * 2


def test_a_preset_model_says_its_regime_and_each_selection_its_share_of_columns_that_stay(tmp_path):
    """--model trains on random token ids (the header says so); every timed selection step records
    ``select_stay`` (docs/design.md, Algorithm step 2), the others None."""
    out = tmp_path / "stay.json"
    res = invoke("--model", "tiny-llama", "--seq-len", "16", "--batch", "2", "--dtype", "fp32", "--topk", "0.1",
                 "--interval", "4", "--warmup", "4", "--iterations", "2", "--device", "cpu", "--baselines", "none",
                 "--set", "zenflow.select_interval=4", "--json", str(out))
    assert res.exit_code == 0, res.output
    assert "uniformly random token ids" in " ".join(res.output.split())
    (row,) = json.loads(out.read_text())["results"]
    recs = row["records"]
    assert [r["selection"] for r in recs] == [True, False, False, False] * 2  # the first selection: in the warm-up
    assert all((r["select_stay"] is not None) == r["selection"] for r in recs)
    assert all(0 <= r["select_stay"] <= 1 for r in recs if r["selection"])
