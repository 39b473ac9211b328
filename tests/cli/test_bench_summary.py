"""The bench's arithmetic: grid parsing, window lengths, and averages that are never diluted."""

from __future__ import annotations

import csv
import io
import json

import pytest

from zfctl.bench.grid import (
    BenchConfig,
    build_grid,
    measured_steps,
    parse_intervals,
    parse_layouts,
    parse_switch,
    parse_topks,
    reference_interval,
    warmup_steps,
)
from zfctl.bench.report import CSV_COLUMNS, render_csv, render_json
from zfctl.bench.runner import ConfigResult, StepRecord, TrialResult
from zfctl.bench.summary import add_speedups, summarize
from zfctl.errors import UserError
from zfctl.offload.config import ZenFlowConfig


def rec(
    ms: float, update: bool, *, cpu: float = 0.0, stall: float = 0.0, d2h: int = 0, h2d: int = 0
) -> StepRecord:
    return StepRecord(
        update=update,
        step_ms=ms,
        fwd_ms=ms / 4,
        bwd_ms=ms / 2,
        opt_ms=ms / 4,
        device_opt_ms=0.1,
        offload_ms=0.2,
        cpu_step_ms=cpu,
        stall_ms=stall,
        d2h_bytes=d2h,
        h2d_bytes=h2d,
        skipped=False,
    )


def result(cfg: BenchConfig, records: list[StepRecord]) -> ConfigResult:
    res = ConfigResult(cfg, warmup_steps=4, steps=len(records))
    res.trials.append(
        TrialResult(
            records, window_wall_ms=sum(r.step_ms for r in records) + 1.0, loss_first=7.0, loss_last=6.9
        )
    )
    return res


ZF = BenchConfig("zenflow", 0.1, 4, True, True)
ZO = BenchConfig("zero-offload", 0.0, 1, False, True)


def test_each_step_kind_is_averaged_only_over_its_own_steps():
    # Two intervals of U=4: three 10 ms accumulation steps, then a 30 ms update step (stall 8 ms,
    # 1000 B down every step, 4000 B up at the update).
    steps = [
        rec(10, False, d2h=1000),
        rec(10, False, d2h=1000),
        rec(12, False, d2h=1000),
        rec(30, True, cpu=20, stall=8, d2h=1000, h2d=4000),
    ] * 2
    row = summarize(result(ZF, steps), param_bytes=8000, samples_per_step=1, tokens_per_step=1)
    s = row["step_ms"]
    assert s["accumulate"] == {"mean": pytest.approx(32 / 3), "median": 10, "n": 6}
    assert s["update"] == {"mean": 30, "median": 30, "n": 2}
    assert s["overall"]["mean"] == pytest.approx(124 / 8) and s["overall"]["n"] == 8
    # The reference's table would report sum(update times) / all lines = 60 / 8 = 7.5 ms as the
    # "step" time: below even the accumulation mean. Ours sits between the two kinds.
    assert s["accumulate"]["mean"] < s["overall"]["mean"] < s["update"]["mean"]
    # CPU step: averaged over the 2 steps where a CPU update completed, not over all 8.
    assert row["cpu_step_ms"] == {"mean": 20, "median": 20, "n": 2}
    assert row["stall_ms"]["mean"] == pytest.approx(16 / 8)
    assert row["stall_update_ms"]["mean"] == 8
    assert row["stall_fraction"] == pytest.approx(16 / 124)
    assert row["d2h_bytes_per_step"] == 1000 and row["h2d_bytes_per_step"] == 1000
    assert row["traffic_x_model"] == pytest.approx(2000 / 8000)
    assert row["samples_per_s"] == pytest.approx(1e3 / (124 / 8))
    assert row["wall_ms_per_step"] == pytest.approx(125 / 8)


def test_skipped_fp16_steps_count_in_overall_only():
    skipped = rec(2, False)
    skipped.skipped = True
    row = summarize(
        result(ZF, [rec(10, False), skipped, rec(30, True)]),
        param_bytes=1,
        samples_per_step=1,
        tokens_per_step=1,
    )
    assert row["n_skipped"] == 1
    assert row["step_ms"]["accumulate"]["n"] == 1 and row["step_ms"]["accumulate"]["mean"] == 10
    assert row["step_ms"]["overall"] == {"mean": 14, "median": 10, "n": 3}


def test_a_kind_no_step_has_is_none_and_speedup_uses_the_same_pin_baseline():
    zo_pin = result(ZO, [rec(40, True, cpu=25)] * 4)
    zo_nopin = result(BenchConfig("zero-offload", 0.0, 1, False, False), [rec(50, True)] * 4)
    zf_nopin = result(BenchConfig("zenflow", 0.1, 4, True, False), [rec(10, False)] * 3 + [rec(30, True)])
    rows = [
        summarize(r, param_bytes=1, samples_per_step=1, tokens_per_step=1)
        for r in (zo_pin, zo_nopin, zf_nopin)
    ]
    add_speedups(rows)
    assert rows[0]["step_ms"]["accumulate"] == {"mean": None, "median": None, "n": 0}
    assert rows[0]["speedup_vs_zero_offload"] == 1.0
    assert rows[2]["speedup_vs_zero_offload"] == pytest.approx(50 / 15)  # vs zero-offload with pin off
    assert rows[1]["cpu_step_ms"]["mean"] is None  # no CPU update completed: '-' not 0


def test_csv_and_json_carry_every_row_and_leave_missing_values_empty():
    rows = [
        summarize(
            result(c, [rec(10, False), rec(30, True)]), param_bytes=1, samples_per_step=1, tokens_per_step=1
        )
        for c in (ZO, ZF)
    ]
    rows[0]["step_ms"]["accumulate"] = {"mean": None, "median": None, "n": 0}
    add_speedups(rows)
    table = list(csv.DictReader(io.StringIO(render_csv(rows))))
    assert list(table[0]) == CSV_COLUMNS and len(table) == 2
    assert table[0]["accumulate_mean_ms"] == "" and float(table[1]["overall_mean_ms"]) == 20.0
    doc = json.loads(render_json({"device": "cpu"}, rows, []))
    assert [r["label"] for r in doc["results"]] == [ZO.label, ZF.label]


def test_grid_layouts_apply_to_zenflow_points_only():
    grid = build_grid([0.1], [4], [True], [True], with_off=True, layouts=["slots", "carry"])
    assert [c.layout for c in grid] == [None, None, "slots", "carry"]  # zero-offload, off keep the base's
    assert [c.label.split(", ")[2] for c in grid[2:]] == ["slots", "carry"]
    base = ZenFlowConfig()
    assert [c.zenflow_config(base).tuning.grad_layout for c in grid] == [base.tuning.grad_layout] * 2 + ["slots", "carry"]
    assert parse_layouts(None) == [None] and parse_layouts("carry,slots,carry") == ["carry", "slots"]
    with pytest.raises(UserError, match="--grad-layout 'ring': use slots, carry"):
        parse_layouts("ring")


def test_grid_has_baselines_first_and_no_duplicates():
    grid = build_grid([0.0, 0.1], [1, 4], [True, False], [True], with_off=True)
    names = [c.name for c in grid]
    assert names[:2] == ["zero-offload", "off"]
    assert (0.0, 1, False) not in [(c.topk, c.interval, c.overlap) for c in grid[2:]]  # == baseline
    assert len(grid) == 2 + 2 * 2 * 2 - 1
    assert [c.pin for c in build_grid([0.1], [4], [True], [True, False], with_off=False)][:2] == [True, False]
    assert "off" not in [c.name for c in build_grid([0.1], [4], [True], [True], with_off=False)]
    cfg = grid[-1].zenflow_config(ZenFlowConfig())
    assert (cfg.topk_ratio, cfg.update_interval, cfg.overlap_step, cfg.full_warm_up_rounds) == (
        0.1,
        4,
        False,
        0,
    )


def test_window_lengths_are_whole_intervals_of_about_the_same_size():
    ref = reference_interval([2, 3, 4, "auto"])
    assert ref == 4
    assert [measured_steps(u, 5, ref) for u in (1, 2, 3, 4, "auto")] == [20, 20, 21, 20, 20]
    assert [warmup_steps(u, 5) for u in (1, 2, 4, "auto")] == [5, 6, 8, 5]
    assert warmup_steps(4, 0) == 0


@pytest.mark.parametrize(
    "fn,text,needle",
    [
        (parse_topks, "0.1,,0.2", "--topk"),
        (parse_topks, "1.5", "[0, 1]"),
        (parse_topks, "ten", "not a number"),
        (parse_intervals, "0", ">= 1"),
        (parse_intervals, "2,x", "--interval"),
    ],
)
def test_bad_grid_values_name_the_flag(fn, text, needle):
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        fn(text)


def test_switch_lists():
    assert parse_switch("overlap", "on,off", False) == [True, False]
    assert parse_switch("overlap", None, False) == [True]
    assert parse_switch("pin", None, True) == [False]
    assert parse_intervals("2,auto,2") == [2, "auto"]
    with pytest.raises(UserError, match="--no-overlap"):
        parse_switch("overlap", "on", True)
    with pytest.raises(UserError, match="--pin 'maybe'"):
        parse_switch("pin", "maybe", False)
