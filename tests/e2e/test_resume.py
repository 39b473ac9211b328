"""Exact resume: N steps straight == k steps, checkpoint, resume to N (bit-identical on CPU).

k lies inside a ZenFlow update interval with overlap_step on, so the checkpoint must carry an
in-flight CPU update, the unfinished interval's accumulators and the selection; any state the
checkpoint forgot shows up as a loss or parameter that differs in the last bits.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zfctl.errors import UserError
from zfctl.plan.io import dump_plan_yaml, load_plan_yaml
from zfctl.plan.resolve import resolve_plan
from zfctl.train import resume, run
from zfctl.train.checkpoint import resolve_checkpoint
from zfctl.train.checksum import file_digest
from zfctl.train.metrics import read_metrics
from zfctl.train.tensorfile import load_state

# One intra-op thread (tests/conftest.py): the straight run and its resume share it, and two threads
# on the loaded 2-core box run this model's steps several times slower.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = [  # a 2-layer, 64-wide tiny-llama: each step takes milliseconds on one core
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=96", "data.max_length=64", "train.micro_batch_size=4", "train.eval_batches=2",
    "train.device=cpu", "train.precision=fp32", "logging.every=1", "train.lr=3e-3", "train.warmup_steps=2",
    "train.schedule=cosine",
]


def tiny_plan(out: Path, *extra: str, zenflow: str | None = None):
    return resolve_plan("tiny-llama", "alpaca-sample", zenflow=zenflow,
                        overrides=[*TINY, f"checkpoint.output_dir={out}", *extra])


def _tensors_equal(a, b, path="") -> None:
    """Recursive bitwise equality of two state dicts (tensors, numbers, containers)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _tensors_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _tensors_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


ZENFLOW = ["zenflow.topk_ratio=0.1", "zenflow.update_interval=4", "zenflow.overlap_step=true",
           "zenflow.select_interval=8", "zenflow.full_warm_up_rounds=1"]


@pytest.mark.slow
@pytest.mark.parametrize("accumulators", [2, 1], ids=["two-slot-sets", "one-slot-set"])
def test_resume_inside_interval_with_overlap_is_bit_identical(tmp_path, accumulators: int):
    # Warm-up step 1 is synchronous; selection at step 2 and 10; CPU-update boundaries at steps 5
    # and 9. At k=6 the update submitted at step 5 is still in flight (installed at step 9 by the
    # straight run): the checkpoint must carry it as "pending", not install it early. With one
    # slot set, step 6 wrote the slots that update was reading (zfctl/offload/grads/acc_gate.py).
    n, k = 11, 6
    straight = tiny_plan(tmp_path / "straight", *ZENFLOW, f"train.max_steps={n}", f"checkpoint.every={k}",
                         "checkpoint.keep_last=5", "train.eval_every=4",
                         f"zenflow.tuning.host_accumulators={accumulators}")
    res_a = run(straight)
    assert res_a.steps == n and res_a.last_checkpoint.name == f"step-{n:06d}"

    # A second run folder holding only the straight run's step-k checkpoint: resume it to N.
    branch = tmp_path / "branch"
    (branch / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoints" / f"step-{k:06d}",
                    branch / "checkpoints" / f"step-{k:06d}")
    res_b = resume(branch)
    assert res_b.steps == n and res_b.output_dir == branch

    a = read_metrics(tmp_path / "straight" / "metrics.jsonl", "train")
    assert [r["step"] for r in a if r["boundary"]] == [1, 5, 9] and a[1]["selection"]
    mid = load_state(branch / "checkpoints" / f"step-{k:06d}" / "optimizer-rank00000.safetensors")
    assert mid["counters"]["pending_install"] and mid["counters"]["interval_len"] == 1
    b = read_metrics(branch / "metrics.jsonl", "train")
    assert [r["step"] for r in b] == list(range(k + 1, n + 1))
    assert [r["loss"] for r in a[k:]] == [r["loss"] for r in b]  # bitwise: floats compared with ==
    assert [r["lr"] for r in a[k:]] == [r["lr"] for r in b]
    assert res_a.final_eval_loss == res_b.final_eval_loss
    assert a[-1]["loss"] < a[0]["loss"]  # it trained

    ca = tmp_path / "straight" / "checkpoints" / f"step-{n:06d}"
    cb = branch / "checkpoints" / f"step-{n:06d}"
    _tensors_equal(load_file(ca / "model.safetensors"), load_file(cb / "model.safetensors"), "model")
    _tensors_equal(load_state(ca / "optimizer-rank00000.safetensors", lazy=False),
                   load_state(cb / "optimizer-rank00000.safetensors", lazy=False), "optimizer")
    ta, tb = (torch.load(c / "trainer.pt", weights_only=False) for c in (ca, cb))
    assert ta["sampler"] == tb["sampler"] and ta["scheduler"] == tb["scheduler"]


@pytest.mark.slow
def test_a_checkpoint_in_the_torch_save_format_still_resumes_exactly(tmp_path):
    """Checkpoints written before the optimizer state was streamed hold ``optimizer-rankR.pt``
    (torch.save of copies, with the pending update's bf16 ``upload`` buffer): they resume bit for
    bit, the install computing the same bf16 values from the master."""
    n, k = 9, 6  # step 6 holds the update submitted at 5 (pending); the straight run installs it at 9
    common = [*ZENFLOW, "train.precision=bf16", f"train.max_steps={n}", "train.eval_every=0",
              "checkpoint.keep_last=5", f"checkpoint.every={k}"]
    res_a = run(tiny_plan(tmp_path / "straight", *common))
    assert res_a.steps == n
    branch = tmp_path / "branch" / "checkpoints"
    branch.mkdir(parents=True)
    ckpt = branch / f"step-{k:06d}"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / f"step-{k:06d}", ckpt)
    new = ckpt / "optimizer-rank00000.safetensors"
    state = load_state(new, lazy=False)
    assert state["counters"]["pending_install"]  # the old format carried the upload buffer then
    for piece in state["host"]:
        piece["upload"] = piece["master"].to(torch.bfloat16)
    torch.save(state, ckpt / "optimizer-rank00000.pt")
    new.unlink()
    meta = json.loads((ckpt / "meta.json").read_text())
    for d in (meta["files"], meta["digests"]):
        del d["optimizer-rank00000.safetensors"]
    meta["files"]["optimizer-rank00000.pt"] = (ckpt / "optimizer-rank00000.pt").stat().st_size
    meta["digests"]["optimizer-rank00000.pt"] = file_digest(ckpt / "optimizer-rank00000.pt")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    res_b = resume(tmp_path / "branch")
    assert res_b.steps == n
    a = read_metrics(tmp_path / "straight" / "metrics.jsonl", "train")
    b = read_metrics(tmp_path / "branch" / "metrics.jsonl", "train")
    assert [r["loss"] for r in a[k:]] == [r["loss"] for r in b]
    _tensors_equal(load_file(tmp_path / "straight" / "checkpoints" / f"step-{n:06d}" / "model.safetensors"),
                   load_file(branch / f"step-{n:06d}" / "model.safetensors"), "model")


@pytest.mark.slow
def test_k_steps_then_resume_max_steps_matches_straight(tmp_path):
    """The literal user flow: a run that ends at k, then `zfctl resume --max-steps N`. With a
    constant schedule the LR does not depend on the planned length, so N straight must match."""
    common = [*ZENFLOW, "train.schedule=constant", "checkpoint.every=0", "train.eval_every=0"]
    # 8 steps: after the resume at 3 the run meets the CPU-update boundary at 5 (its update in flight to the end)
    run(tiny_plan(tmp_path / "a", *common, "train.max_steps=8"))
    run(tiny_plan(tmp_path / "b", *common, "train.max_steps=3"))
    res = resume(tmp_path / "b", max_steps=8)
    assert res.steps == 8
    la = [r["loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl", "train")]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl", "train")]
    assert la == lb
    pa = load_file(tmp_path / "a" / "checkpoints" / "step-000008" / "model.safetensors")
    pb = load_file(tmp_path / "b" / "checkpoints" / "step-000008" / "model.safetensors")
    _tensors_equal(pa, pb, "model")
    assert load_plan_yaml(tmp_path / "b" / "plan.yaml").train.max_steps == 8


@pytest.mark.slow
def test_changed_plan_is_refused_then_allowed(tmp_path):
    out = tmp_path / "run"
    run(tiny_plan(out, "train.max_steps=2", "zenflow.topk_ratio=1.0"))  # a checkpoint to resume: steps do not matter
    plan = load_plan_yaml(out / "plan.yaml")
    dump_plan_yaml(replace(plan, train=replace(plan.train, lr=1e-4)), out / "plan.yaml")
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(UserError, match=r"train\.lr: 0\.003 -> 0\.0001.*--allow-changes") as e:
        resume(out, max_steps=3)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    res = resume(out, max_steps=3, allow_changes=True)
    assert res.steps == 3
    assert read_metrics(out / "metrics.jsonl", "train")[-1]["lr"] == pytest.approx(1e-4)  # new peak LR
    # a change the saved optimizer state cannot follow is still one clear line, even when allowed
    plan = load_plan_yaml(out / "plan.yaml")
    dump_plan_yaml(replace(plan, zenflow=replace(plan.zenflow, topk_ratio=0.5)), out / "plan.yaml")
    with pytest.raises(UserError, match="optimizer state does not fit this plan.*topk_ratio"):
        resume(out, max_steps=4, allow_changes=True)
    assert resolve_checkpoint(out).step == 3


def test_resume_on_a_world_size_that_cannot_keep_the_global_batch_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(tiny_plan(out, "train.max_steps=1", "zenflow.topk_ratio=1.0"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    # 1 micro-batch per step cannot be shared by 2 processes: the global batch could not be kept
    with pytest.raises(UserError, match=r"cannot resume on 2 process\(es\).*global batch is 4 sequences.*--nproc 1$"):
        resume(out, max_steps=2)
