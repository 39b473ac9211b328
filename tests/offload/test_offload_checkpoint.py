"""state_dict / load_state_dict: stopping anywhere (mid-interval, with an update in flight) and
resuming into fresh objects continues the same trajectory bit for bit."""

from __future__ import annotations

import io
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_offload_helpers import batches, snapshot, tiny_net, zen

from zfctl.offload import ZenFlowOptimizer

# fc2 and head are the "vocabulary" matrices: split by row where a config says vocab_select: rows.
HP = {"lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 1.0, "vocab_params": ["fc2.weight", "head.weight"]}
STEPS, STOP = 20, 10


def steps(model, opt, data) -> list:
    out = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        opt.scale_loss(loss).backward()
        out.append(opt.step())
    return out


CONFIGS = {
    # boundaries 3, 7, 11; at the stop (after step 9) the update submitted at step 7 is in flight;
    # re-selection at step 12 drains the pipeline after the resume.
    "overlap": zen(topk_ratio=0.1, update_interval=4, overlap_step=True, select_interval=12),
    "sequential": zen(topk_ratio=0.1, update_interval=4, overlap_step=False),
    "auto": zen(topk_ratio=0.1, update_interval="auto", overlap_step=True, auto_ratio=0.5),
    "warmup": zen(topk_ratio=0.1, update_interval=3, full_warm_up_rounds=12),
    # The update submitted at step 7 is due at step 10 (install_lag 3): in flight at the stop.
    "lag": zen(topk_ratio=0.1, update_interval=4, overlap_step=True, select_interval=12, install_lag=3),
    "by-row": zen(topk_ratio=0.1, update_interval=4, overlap_step=True, select_interval=12, vocab_select="rows",
                  deferred_lr_scale="repeat"),
    # One host accumulator (acc_gate.py): at the stop the next interval's sum shares it with the
    # update in flight; the hook-less step() path writes it.
    "one-acc": zen(topk_ratio=0.1, update_interval=4, overlap_step=True, select_interval=12, host_accumulators=1),
    "one-acc-lag": zen(topk_ratio=0.1, update_interval=4, overlap_step=True, select_interval=12, install_lag=3,
                       host_accumulators=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_resume_mid_interval_is_bit_identical(name: str, dtype: torch.dtype) -> None:
    _resume_mid_interval(name, dtype, HP)


@pytest.mark.parametrize("name", ["overlap", "one-acc", "sequential"])
def test_resume_mid_interval_with_clipping_is_bit_identical(name: str) -> None:
    """Every step clips (max_grad_norm 0.05 against norms of 0.3-0.9), so the interval's clip
    factors differ: the saved raw sum and ``clip_sum`` continue bit for bit (pipeline.py)."""
    _resume_mid_interval(name, torch.float32, {**HP, "max_grad_norm": 0.05}, clipped=True)


def _resume_mid_interval(name: str, dtype: torch.dtype, hp: dict, clipped: bool = False) -> None:
    cfg, data = CONFIGS[name], batches(STEPS, dtype=dtype)
    model = tiny_net(dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **hp) as opt:
        straight = steps(model, opt, data)
    expected = snapshot(model)
    if clipped:
        assert min(s.grad_norm for s in straight) > 2 * hp["max_grad_norm"]

    model = tiny_net(dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **hp) as opt:
        steps(model, opt, data[:STOP])
        in_flight = opt.pipeline.busy
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        if clipped:
            assert 0 < opt.pipeline.clip_sum < opt.pipeline.interval_len  # clipped steps are saved
    if name in ("overlap", "by-row", "lag", "one-acc", "one-acc-lag"):
        assert in_flight  # the interesting case really happened
    if name != "sequential":
        assert [s.boundary for s in straight[STOP:]] != [False] * (STEPS - STOP)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model = tiny_net(seed=123, dtype=dtype)  # different init: everything must come from the checkpoint
    model.load_state_dict(saved["model"])
    with ZenFlowOptimizer(model.named_parameters(), cfg, **hp) as opt:
        opt.load_state_dict(saved["opt"])
        resumed = steps(model, opt, data[STOP:])
    got = snapshot(model)
    assert all(torch.equal(expected[n], got[n]) for n in expected)
    keys = ("step", "boundary", "selection", "installed", "update_interval", "grad_norm")
    for a, b in zip(straight[STOP:], resumed):
        assert [getattr(a, k) for k in keys] == [getattr(b, k) for k in keys]


@pytest.mark.parametrize(("saved_with", "resumed_with"), [(2, 1), (1, 2)])
def test_a_state_resumes_under_the_other_host_accumulator_count(saved_with: int, resumed_with: int) -> None:
    """zenflow.tuning.host_accumulators changes waits, not values: a state saved with one count
    continues bit for bit under the other (the saved sum becomes the current slot set's carry).
    Stopped after step 5: the update of boundary 3 in flight, two sets at ``cur`` 1."""
    data, stop = batches(STEPS), 6
    cfgs = {n: replace(CONFIGS["overlap"], tuning=replace(CONFIGS["overlap"].tuning, host_accumulators=n))
            for n in (1, 2)}
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfgs[saved_with], **HP) as opt:
        steps(model, opt, data)
    expected = snapshot(model)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfgs[saved_with], **HP) as opt:
        steps(model, opt, data[:stop])
        assert opt.pipeline.busy and opt.pipeline.cur == (1 if saved_with == 2 else 0)
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}
        saved["opt"] = torch.load(_bytes(saved["opt"]), weights_only=True)  # copies, not the live buffers
    model = tiny_net(seed=123)
    model.load_state_dict(saved["model"])
    with ZenFlowOptimizer(model.named_parameters(), cfgs[resumed_with], **HP) as opt:
        assert opt.host is not None and opt.host.grads.sets == resumed_with
        opt.load_state_dict(saved["opt"])
        steps(model, opt, data[stop:])
    got = snapshot(model)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def _bytes(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_format_1_flat_host_buffers_still_resume_exactly() -> None:
    """A state saved before host pieces (format 1: one flat buffer per key, acc among them) and
    before the install read the fp32 master (an ``upload`` buffer of the pending update in bf16)
    loads into the same world size and continues bit for bit: the master holds those values."""
    from zfctl.offload.parallel.pieces import gather_host
    from zfctl.offload.state import FORMAT_V1

    cfg, data = CONFIGS["overlap"], batches(STEPS, dtype=torch.bfloat16)
    model = tiny_net(dtype=torch.bfloat16)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        steps(model, opt, data)
    expected = snapshot(model)
    model = tiny_net(dtype=torch.bfloat16)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        steps(model, opt, data[:STOP])
        sd, msd = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
        assert opt.pipeline.pending_install  # an update waits to be installed: its values are in the master
        flat = gather_host(opt.layout, sd["host"])
    flat["upload"] = flat["master"].to(torch.bfloat16)  # what the old upload buffer held for it
    old = {**sd, "format": FORMAT_V1, "host": flat, "partition": {"world_size": 1, "rank": 0}}
    model = tiny_net(seed=123, dtype=torch.bfloat16)
    model.load_state_dict(msd)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        opt.load_state_dict(old)
        steps(model, opt, data[STOP:])
    got = snapshot(model)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_state_must_match_the_optimizer() -> None:
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), CONFIGS["sequential"]) as opt:
        sd = opt.state_dict()
    other = zen(topk_ratio=0.2)
    with ZenFlowOptimizer(model.named_parameters(), other) as opt, pytest.raises(ValueError, match="topk_ratio"):
        opt.load_state_dict(sd)
    rows = replace(CONFIGS["sequential"], vocab_select="rows")
    with ZenFlowOptimizer(model.named_parameters(), rows, vocab_params=["head.weight"]) as opt:
        with pytest.raises(ValueError, match=r"saved with zenflow.vocab_select=columns .*resume with zenflow.vocab_select=columns"):
            opt.load_state_dict(sd)
        by_row = opt.state_dict()
    saved_rows = r"saved with zenflow.vocab_select=rows \(matrices split by row: \['head.weight'\]\)"
    with ZenFlowOptimizer(model.named_parameters(), CONFIGS["sequential"]) as opt, \
            pytest.raises(ValueError, match=saved_rows):
        opt.load_state_dict(by_row)
    fewer = list(model.named_parameters())[:-1]
    with ZenFlowOptimizer(fewer, CONFIGS["sequential"]) as opt, pytest.raises(ValueError, match="parameter"):
        opt.load_state_dict(sd)


def test_state_module_uses_the_parts_not_the_optimizer() -> None:
    """The components save themselves; state.py assembles them through the optimizer's public
    parts and imports no engine class but the pieces it cuts (so no import cycle)."""
    import ast

    from zfctl.offload import state

    tree = ast.parse(Path(state.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m and m.startswith("zfctl")} == {"zfctl.offload.parallel.pieces"}


def test_pipeline_round_trips_its_counters() -> None:
    model = tiny_net()
    cfg = CONFIGS["overlap"]
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        steps(model, opt, batches(6))
        clip_sum = opt.pipeline.clip_sum
        sd = opt.pipeline.state_dict()
        sum_of_slots = sd["acc"].clone()
    # age: steps 3, 4 and 5 done since the boundary at step 3 submitted the pending update
    assert sd["counters"] == {"t": 6, "interval_len": 2, "last_interval": 4, "cur": 1, "pending_install": True,
                              "age": 3, "clip_sum": clip_sum, "raw_sums": True}
    with ZenFlowOptimizer(tiny_net().named_parameters(), cfg, **HP) as opt:
        opt.pipeline.load_state_dict(sd)
        assert opt.pipeline.t == 6 and opt.pipeline.interval_len == 2 and opt.pipeline.pending_install
        assert opt.pipeline.age == 3 and opt.host.grads.used(1) == 0  # the two steps are in the carry
        assert opt.pipeline.clip_sum == clip_sum
        assert opt.host.grads.carry[1] is sd["acc"] and torch.equal(opt.pipeline.state_dict()["acc"], sum_of_slots)


def test_a_checkpoint_streams_the_interval_sum_chunk_by_chunk() -> None:
    """``checkpoint_state`` gives the unfinished interval's sum as pieces formed when read
    (cpu/partial.py): the same bits as the buffer ``state_dict`` forms (device-owned columns
    zeroed), whichever chunk size cuts them, one that cuts columns included, with no buffer of
    the sum in the state."""
    from zfctl.offload.cpu.partial import PartialSum
    from zfctl.offload.parallel.pieces import gather_host

    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), CONFIGS["overlap"], **HP) as opt:
        steps(model, opt, batches(6))
        want = gather_host(opt.layout, opt.state_dict()["host"])["acc"]
        streamed = opt.checkpoint_state()
        pieces = [p["acc"] for p in streamed["host"]]
        assert all(isinstance(p, PartialSum) for p in pieces)
        flat = torch.cat([p.load().reshape(-1) for p in pieces])
        assert torch.equal(flat, want) and bool(flat.ne(0).any())
        for nbytes in (4, 4 * 1000):  # one column at a time, several
            chunks = torch.cat([c.clone() for p in pieces for c in p.chunks(nbytes)])
            assert torch.equal(chunks, want), nbytes
        whole = opt.pipeline.state_dict(stream=True)["acc"]  # flat: 7-element chunks cut columns
        assert torch.equal(torch.cat([c.clone() for c in whole.chunks(4 * 7)]), want)


def test_a_raw_sum_state_loads_exactly_and_a_per_step_one_counts_its_steps_as_unclipped() -> None:
    """A state whose sum is raw (``raw_sums``: this format, and the one written before the slots
    under release_grads) loads its sum and ``clip_sum`` as saved. One written by the per-step
    rule (no ``raw_sums``: its sum has each step's factor in it) loads its sum as it is, its
    saved steps counting ``k = 1`` each, with one warning (pipeline.py)."""
    from zfctl.offload.cpu.pipeline import StateNote

    model = tiny_net()
    cfg = CONFIGS["overlap"]
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        steps(model, opt, batches(6))
        sd = opt.pipeline.state_dict()
        raw = sd["acc"].clone()
    per_step = {k: v for k, v in sd["counters"].items() if k not in ("clip_sum", "raw_sums")}
    for counters, clip_sum in (({**sd["counters"], "clip_sum": 1.5}, 1.5), (per_step, 2.0),
                               ({**per_step, "clip_sum": 1.5, "raw_sums": False}, 2.0)):
        old = {**sd, "counters": counters, "acc": raw.clone()}
        with ZenFlowOptimizer(tiny_net().named_parameters(), cfg, **HP) as opt:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                opt.pipeline.load_state_dict(old)
            notes = [str(w.message) for w in seen if issubclass(w.category, StateNote)]
            assert len(notes) == (0 if counters.get("raw_sums") else 1), notes
            carry = opt.host.grads.carry[1]
            assert carry is not None and torch.equal(carry, raw), counters
            assert opt.pipeline.clip_sum == clip_sum, counters


def test_a_checkpoint_file_inside_an_interval_streams_its_sum_and_resumes_exactly(tmp_path: Path, monkeypatch) -> None:
    """The checkpoint writer (zfctl/train/tensorfile.py) writes ``checkpoint_state``'s interval sum
    a chunk at a time (here 256 B: the sum is formed in ranges, never whole), and the file resumes
    bit for bit, every step clipping: a SIGTERM save inside an interval needs no buffer of the sum."""
    from zfctl.offload.grads.slots import GradSlots
    from zfctl.train import checksum
    from zfctl.train.tensorfile import load_state, save_state_hashed

    hp, cfg, data = {**HP, "max_grad_norm": 0.05}, CONFIGS["overlap"], batches(STEPS)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, **hp) as opt:
        steps(model, opt, data)
    expected = snapshot(model)
    ranges: list[int] = []
    into = GradSlots.partial_sum_into
    monkeypatch.setattr(GradSlots, "partial_sum_into",
                        lambda self, s, out, lo, hi: (ranges.append(hi - lo), into(self, s, out, lo, hi))[1])
    monkeypatch.setattr(checksum, "CHUNK_BYTES", 256)
    model = tiny_net()
    with ZenFlowOptimizer(model.named_parameters(), cfg, **hp) as opt:
        steps(model, opt, data[:STOP])
        assert opt.pipeline.interval_len == 2 and opt.pipeline.clip_sum < 2
        save_state_hashed(opt.checkpoint_state(), tmp_path / "opt.safetensors")
        numel = opt.layout.host_numel
        msd = {k: v.clone() for k, v in model.state_dict().items()}
    assert ranges and max(ranges) < numel and sum(ranges) == numel
    model = tiny_net(seed=123)
    model.load_state_dict(msd)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **hp) as opt:
        opt.load_state_dict(load_state(tmp_path / "opt.safetensors"))
        steps(model, opt, data[STOP:])
    got = snapshot(model)
    assert all(torch.equal(expected[n], got[n]) for n in expected)
