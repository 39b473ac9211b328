"""The plan is the truth: what `zfctl plan` promises is what the code allocates.

The optimizer is built for real models on CPU, every tensor it holds is found by walking its
object graph (so a buffer added anywhere in the engine is counted, whether or not a plan line
knows it), and the total is compared with the plan's lines for the engine, within 2%, on every
gradient path. Plus the acceptance numbers of Llama-2-7B on one 80 GB GPU and a 128 GB host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from dataclasses import fields, is_dataclass

import pytest
import torch
from torch.distributed.tensor import DTensor

from zfctl.plan import resolve_plan
from zfctl.plan.memory import GB, Machine, estimate, parse_size
from zfctl.train.models.load import load_model
from zfctl.train.optim import build_optimizer

TINY_LLAMA = []  # the preset as it is: untied embeddings, 4 layers, hidden 256
GQA_TIED = ["model.config.num_key_value_heads=2", "model.config.tie_word_embeddings=true",
            "model.config.intermediate_size=512"]


def held_bytes(root: object, exclude: set[int]) -> int:
    """Bytes of every distinct tensor storage reachable from ``root`` through zfctl objects and
    containers (views of one storage count once), except the storages in ``exclude``."""
    seen_obj: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    todo: deque[object] = deque([root])
    while todo:
        obj = todo.popleft()
        if id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, DTensor):  # an FSDP2 parameter (tests/offload/test_fsdp.py): its local shard
            todo.append(obj.to_local())
        elif isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            if st.data_ptr() not in exclude and st.nbytes():
                storages[(str(obj.device), st.data_ptr())] = st.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            todo.extend(obj)
        elif is_dataclass(obj) and not isinstance(obj, type):
            todo.extend(getattr(obj, f.name) for f in fields(obj))
        elif type(obj).__module__.startswith("zfctl") and hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return sum(storages.values())


def train_steps(model, opt, steps: int, announce: bool = True) -> None:
    """``steps`` steps of the tiny model on one fixed batch: hook-path steps, or (``announce``
    False: a library loop that announces no final backward) step-path ones."""
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if announce:
            opt.prepare_backward(final=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def engine_lines(est) -> float:
    """The plan's engine lines (a resume inside an interval adds ``est.resume_carry``, a note)."""
    return sum(i.bytes for i in est.items if i.code.startswith("zfctl/offload"))


def engine_bytes(plan_overrides: list[str], model_overrides: list[str], steps: int = 3,
                 announce: bool = True) -> tuple[int, float]:
    """(bytes the optimizer holds after ``steps`` steps, the plan's engine lines) on CPU.
    ``announce`` False (the step() path): with ``release_grads`` off, as nothing is released
    without an announced backward; the plan, made for zfctl's loop, would count a release
    selection's fourth staging pair otherwise (lines.py ``regather``)."""
    if not announce:
        plan_overrides = [*plan_overrides, "zenflow.tuning.release_grads=false"]
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=model_overrides + plan_overrides +
                        ["train.device=cpu", "zenflow.full_warm_up_rounds=0", "train.precision=fp32"])
    model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=0)
    opt = build_optimizer(model, plan, steps_per_epoch=100)
    try:
        train_steps(model, opt, steps, announce)
        opt.zero_grad(set_to_none=True)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        held = held_bytes(opt, params)
    finally:
        opt.close()
    return held, engine_lines(estimate(plan, Machine(64 * GB, False)))


@pytest.mark.parametrize("model", [TINY_LLAMA, GQA_TIED], ids=["tiny-llama", "gqa-tied"])
@pytest.mark.parametrize("accumulate", ["host", "device"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("announce", [True, False], ids=["hooks", "step-path"])
def test_engine_allocates_what_the_plan_says(model, accumulate, overlap, announce) -> None:
    held, planned = engine_bytes([f"zenflow.accumulate={accumulate}", f"zenflow.overlap_step={overlap}",
                                  "zenflow.select_interval=4", "zenflow.update_interval=2"], model,
                                 announce=announce)
    assert held == pytest.approx(planned, rel=0.02), (held, planned)


@pytest.mark.parametrize("model", [TINY_LLAMA, GQA_TIED], ids=["tiny-llama", "gqa-tied"])
@pytest.mark.parametrize("announce", [True, False], ids=["hooks", "step-path"])
def test_one_slot_set_with_overlap_allocates_what_the_plan_says(model, announce) -> None:
    """The host paths with overlap_step and zenflow.tuning.host_accumulators: 1 (acc_gate.py):
    one set of gradient slots, and the plan's line says so; a second set is exactly one set more."""
    sets = ["zenflow.accumulate=host", "zenflow.overlap_step=true", "zenflow.select_interval=4",
            "zenflow.update_interval=2"]
    held, planned = engine_bytes([*sets, "zenflow.tuning.host_accumulators=1"], model, announce=announce)
    assert held == pytest.approx(planned, rel=0.02), (held, planned)
    held2, planned2 = engine_bytes([*sets, "zenflow.tuning.host_accumulators=2"], model, steps=1,
                                   announce=announce)
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[*model, *sets, "train.device=cpu",
                                                                  "train.precision=fp32",
                                                                  "zenflow.tuning.host_accumulators=1"])
    one_set = estimate(plan, Machine(64 * GB, False)).item("gradient slots")
    assert held2 - held == planned2 - planned == one_set  # exactly one set more
    assert one_set == 2 * 4 * plan_numel(plan)  # update_interval 2: two fp32 slots per host element


def plan_numel(plan) -> int:
    """H: the host-column elements of the plan's layout, from its 'fp32 master' line (4 B each)."""
    return int(estimate(plan, Machine(64 * GB, False)).item("fp32 master")) // 4


def test_a_resume_inside_an_interval_holds_what_its_plan_note_says() -> None:
    """Saved after one step of an interval, the state holds that interval's fp32 sum, and an
    optimizer resumed from it under slots holds it as its carry until the interval's update: the
    engine lines plus the estimate's transient ``resume_carry`` (a note, not a line: the host
    total does not hold it) are what it holds then."""
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        "train.device=cpu", "zenflow.full_warm_up_rounds=0", "train.precision=fp32", "zenflow.accumulate=host",
        "zenflow.select_interval=4", "zenflow.update_interval=2"])
    model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with build_optimizer(model, plan, steps_per_epoch=100) as opt:
        train_steps(model, opt, 3)  # boundaries at 1 and 3 (interval 2): one step into [2, 3]
        sd = opt.state_dict()
        assert sd["counters"]["interval_len"] == 1
        saved = [p["acc"] for p in sd["host"]]
    with build_optimizer(model, plan, steps_per_epoch=100) as opt:
        opt.load_state_dict(sd)
        del sd, saved
        opt.zero_grad(set_to_none=True)
        held = held_bytes(opt, params)
    est = estimate(plan, Machine(64 * GB, False))
    # The selection staging is made at the first selection, which the resumed optimizer has not run.
    planned = engine_lines(est) - est.item("selection staging") + est.resume_carry
    assert held == pytest.approx(planned, rel=0.02), (held, planned)
    assert est.grad_layout == "slots" and est.resume_carry == 4 * plan_numel(plan)
    assert est.item("checkpoint interval sum") == 0 and any("a resume inside an interval" in n for n in est.notes)
    assert held - engine_lines(est) + est.item("selection staging") == pytest.approx(4 * plan_numel(plan), rel=0.1)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_upload_buffer_line_is_what_the_engine_allocates(precision) -> None:
    """bf16: the engine holds the upload buffer the CPU AdamW writes for the install (2 B per host
    element, zfctl/offload/cpu/host.py) and the plan has its line; fp32 has neither."""
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        "train.device=cpu", f"train.precision={precision}", "zenflow.full_warm_up_rounds=0",
        "zenflow.accumulate=host", "zenflow.select_interval=4", "zenflow.update_interval=2"])
    model = load_model(plan.model, precision=precision, device=torch.device("cpu"), seed=0)
    opt = build_optimizer(model, plan, steps_per_epoch=100)
    try:
        train_steps(model, opt, 3)
        opt.zero_grad(set_to_none=True)
        held = held_bytes(opt, {p.untyped_storage().data_ptr() for p in model.parameters()})
        upload = opt.host.upload
    finally:
        opt.close()
    est = estimate(plan, Machine(64 * GB, False))
    planned = engine_lines(est)  # no checkpoint inside an interval: no interval sum held
    assert held == pytest.approx(planned, rel=0.02), (held, planned)
    if precision == "bf16":
        assert est.item("upload buffer") == upload.numel() * 2 == est.item("fp32 master") / 2
        assert est.upload_buffer
    else:
        assert upload is None and "upload buffer" not in {i.name for i in est.items}


def test_the_upload_buffer_is_planned_where_the_host_holds_it() -> None:
    """zenflow.tuning.upload_buffer: auto adds the bf16 copy (2 B per host element) only where the
    host total with it fits: Llama-2-7B on a 128 GB host has no room for its 13.5 GB (the install
    then moves the fp32 master, page-locked instead), a 256 GB host has."""
    plan = resolve_plan("llama2-7b", "alpaca", overrides=["machine.gpu_memory=80GB", "machine.host_memory=128GB",
                                                          "zenflow.tuning.grad_layout=carry",
                                                          "zenflow.tuning.staging_mb=256"])
    small = estimate(plan)
    assert not small.upload_buffer and small.item("upload buffer") == 0 and small.fits
    assert "page-locked" in next(i for i in small.items if i.name == "fp32 master").note
    assert any("upload_buffer (auto): off" in n for n in small.notes)
    big = estimate(plan, Machine(256 * GB, True, "H100", 80 * GB))
    assert big.upload_buffer and big.item("upload buffer") == pytest.approx(big.item("fp32 master") / 2)
    assert "page-locked" not in next(i for i in big.items if i.name == "fp32 master").note
    assert big.host_total == pytest.approx(small.host_total + big.item("upload buffer"))
    forced = estimate(replace_tuning(plan, upload_buffer=False), Machine(256 * GB, True, "H100", 80 * GB))
    assert not forced.upload_buffer and forced.host_total == pytest.approx(small.host_total)
    # the install's device slots hold the source's chunks: bf16 with the buffer, the fp32 master's without
    assert small.item("install staging") == 2 * big.item("install staging") == 4 * 64 * 2**20


def replace_tuning(plan, **kw):
    from dataclasses import replace

    return replace(plan, zenflow=replace(plan.zenflow, tuning=replace(plan.zenflow.tuning, **kw)))


def test_host_accumulators_auto_takes_a_second_only_where_it_fits(monkeypatch) -> None:
    """auto = 2 when the host total with the second set of gradient slots stays within what the
    verdict lets the host use; the plan shows the count and the run builds with it for its own machine."""
    from zfctl.plan import machine as machine_mod

    # the edge is counted without the upload buffer, which auto takes only after the accumulators,
    # and with the selection's out buffer fixed (auto grows it into what is left)
    plan = resolve_plan("llama2-7b", "alpaca", overrides=["machine.gpu_memory=48GB", "zenflow.tuning.staging_mb=64"])
    one = resolve_plan("llama2-7b", "alpaca", overrides=["machine.gpu_memory=48GB", "zenflow.tuning.host_accumulators=1",
                                                         "zenflow.tuning.upload_buffer=false",
                                                         "zenflow.tuning.staging_mb=64"])
    base = estimate(one, Machine(1e15, True, "gpu", 48 * GB))
    acc = base.item("gradient slots")
    assert base.host_accumulators == 1 and base.accumulate == "host"
    # host_limit: all but 15 GB of a machine over 60 GB; auto also keeps room for a resume's carry
    edge = base.host_total + acc + base.resume_carry + 15 * GB
    fits, short = (estimate(plan, Machine(ram, True, "gpu", 48 * GB)) for ram in (edge, edge - 1e6))
    assert fits.host_accumulators == 2 and fits.item("gradient slots") == 2 * acc
    assert short.host_accumulators == 1 and short.item("gradient slots") == acc
    assert any("host_accumulators (auto): 1" in n for n in short.notes)
    assert "1 set of 4 slots" in next(i.note for i in short.items if i.name == "gradient slots")
    # The run: tiny-llama on this CPU, for a machine with room for both and one without.
    tiny = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.device=cpu", "train.precision=fp32",
                                                                  "zenflow.accumulate=host"])
    model = load_model(tiny.model, precision="fp32", device=torch.device("cpu"), seed=0)
    for ram, want in ((64 * GB, 2), (1e6, 1)):
        monkeypatch.setattr(machine_mod, "this_machine", lambda ram=ram: Machine(ram, False))
        assert estimate(tiny).host_accumulators == want
        with build_optimizer(model, tiny, steps_per_epoch=100) as opt:
            assert opt.host is not None and opt.host.grads.sets == want, ram


def test_a_buffer_without_a_plan_line_is_caught() -> None:
    """The walk finds a buffer hidden anywhere in the engine: the comparison above can fail. (One
    step first: the selection at step 0 makes the migration's staging, which the plan counts.)"""
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.device=cpu", "train.precision=fp32",
                                                                  "zenflow.full_warm_up_rounds=0"])
    model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=0)
    with build_optimizer(model, plan, steps_per_epoch=100) as opt:
        train_steps(model, opt, 1)
        opt.zero_grad(set_to_none=True)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        before = held_bytes(opt, params)
        assert opt.host is not None
        opt.pipeline.worker._spare = torch.empty(opt.host.master.numel(), dtype=torch.bfloat16)  # an upload copy
        assert held_bytes(opt, params) == before + 2 * opt.host.master.numel()
        planned = engine_lines(estimate(plan, Machine(64 * GB, False)))
        assert held_bytes(opt, params) > 1.02 * planned


def test_llama2_7b_fits_one_80gb_gpu_and_a_128gb_host() -> None:
    plan = resolve_plan("llama2-7b", "alpaca", overrides=["machine.gpu_memory=80GB", "machine.host_memory=128GB"])
    est = estimate(plan)
    assert est.accumulate == "host" and est.grad_layout == "carry" and est.fits, est.reasons
    assert est.host_total <= 113 * GB and est.device_total <= 72 * GB
    p2 = 6.738e9 - (2 * 32 + 1) * 4096  # the 2-D weights
    state = est.host_total - est.item("process baseline")  # the process itself: 2 GB on CUDA, not per param
    assert est.item("process baseline") == 2 * GB
    # 12 B master + moments, 4 B the fp32 carry, its landing ring, bookkeeping, and the selection
    # staging (the in ring and an out buffer sized to a quarter of the host's spare)
    assert state / p2 <= 16.2
    assert est.item("gradient carry") == pytest.approx(4 * p2) and est.item("landing ring") == 4 * 32 * 2**20
    assert est.item("selection staging") <= 1.1 * GB
    assert est.item("gradient slots") == 0 and est.item("checkpoint interval sum") == 0
    # Slots do not fit: 1 set of 4 bf16 slots is 8 B per element more than 113 GB usable hold.
    assert any("does not fit: slots, 2 sets (16 B" in n and "slots, 1 set (8 B" in n for n in est.notes)
    # A GPU too small for the plan: the host layout is the same, the verdict names the device.
    small = estimate(plan, Machine(128 * GB, True, "L4", 24 * GB))
    assert small.accumulate == "host" and small.grad_layout == "carry"
    assert not small.fits and [r.split(":")[0] for r in small.reasons] == ["device memory"]


def test_plan_json_carries_the_verdict_numbers() -> None:
    out = subprocess.run([sys.executable, "-m", "zfctl", "plan", "llama2-7b", "--data", "alpaca",
                          "--gpu-memory", "80GB", "--host-memory", "128GB", "--json"],
                         capture_output=True, text=True, check=True)
    mem = json.loads(out.stdout)["memory"]
    assert mem["fits"] and mem["host_total"] <= 113 * GB and mem["device_total"] <= 72 * GB
    assert mem["machine"]["gpu_mem"] == 80 * GB and mem["machine"]["host_ram"] == 128 * GB
    assert "shapes" not in mem["size"]
    text = subprocess.run([sys.executable, "-m", "zfctl", "plan", "llama2-7b", "--data", "alpaca",
                           "--gpu-memory", "80GB", "--host-memory", "128GB"],
                          capture_output=True, text=True, check=True, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "it fits" in text and f"{mem['host_total'] / GB:.1f} GB" in text



@pytest.mark.parametrize(("flag", "value"), [("--gpu-memory", "80XB"), ("--gpu-memory", "0GB"),
                                              ("--host-memory", "lots"), ("--host-memory", "-5GB")])
def test_a_bad_target_size_is_one_line_exit_2(flag: str, value: str) -> None:
    out = subprocess.run([sys.executable, "-m", "zfctl", "plan", "tiny-llama", "--data", "alpaca-sample",
                          f"{flag}={value}"], check=False, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], out.stderr


def test_parse_size_units() -> None:
    assert parse_size("80GB", "x") == 80e9 and parse_size("128 GiB", "x") == 128 * 2**30
    assert parse_size("1.5TB", "x") == 1.5e12 and parse_size("512mib", "x") == 512 * 2**20


def peak_gradient_bytes(overrides: list[str], steps: int = 6) -> tuple[int, float, int]:
    """(the most bytes of ``.grad`` and hook-path temporaries the device held at once during the
    backwards, the plan's ``gradients`` + ``gradient temporaries in flight`` lines, the largest
    matrix's bytes + the 1-D params'), tiny Llama on CPU (fp32), steps 0 and 4 selecting. A hook
    registered before the optimizer's sees each gradient before it is released, so it catches
    the peak."""
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        "train.device=cpu", "train.precision=fp32", "zenflow.full_warm_up_rounds=0", "zenflow.select_interval=4",
        "zenflow.update_interval=2", *overrides])
    model = load_model(plan.model, precision="fp32", device=torch.device("cpu"), seed=0)
    params = list(model.parameters())
    peak, opt = [0], None

    def watch(_: torch.Tensor) -> None:
        held = sum(q.grad.nbytes for q in params if q.grad is not None)
        stream = getattr(getattr(opt, "gradient_path", None), "stream", None)
        peak[0] = max(peak[0], held + (stream.inflight_bytes if stream is not None else 0))

    for p in params:
        p.register_post_accumulate_grad_hook(watch)
    opt = build_optimizer(model, plan, steps_per_epoch=100)
    try:
        train_steps(model, opt, steps)
    finally:
        opt.close()
    est = estimate(plan, Machine(64 * GB, False))
    planned = est.item("gradients") + est.item("gradient temporaries in flight")
    return peak[0], planned, max(p.nbytes for p in params) + sum(p.nbytes for p in params if p.dim() < 2)


@pytest.mark.parametrize("model", [TINY_LLAMA, GQA_TIED], ids=["tiny-llama", "gqa-tied"])
@pytest.mark.parametrize("topk", ["0.1", "1.0"])
def test_released_gradients_stay_within_the_plan(model, topk) -> None:
    """release_grads: one matrix's .grad at a time (the largest at most) beside the 1-D params', as
    the plan's line says; without it every .grad is held at once (w P), which the same count sees."""
    peak, planned, largest = peak_gradient_bytes([*model, f"zenflow.topk_ratio={topk}"])
    assert planned == largest and largest <= peak <= planned, (peak, planned)
    off, planned_off, _ = peak_gradient_bytes([*model, f"zenflow.topk_ratio={topk}",
                                               "zenflow.tuning.release_grads=false"], steps=2)
    assert off == planned_off > 3 * planned  # w P
