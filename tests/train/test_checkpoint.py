"""Checkpoint folder: atomic install, `latest`, rotation, validation of damaged folders."""

from __future__ import annotations

import json
import random

import pytest
import torch

from zfctl.errors import UserError
from zfctl.train import checkpoint as ck


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    m[1].weight = m[0].weight  # tied, like an LM head: stored once, restored to both
    return m


def _save(run, step, model=None, keep=3):
    return ck.save_checkpoint(
        run, step, model=model or _model(), optimizer_state={"state": {"x": torch.arange(3)}},
        trainer_state={"step": step}, write_plan=lambda p: p.write_text("train: {}\n"),
        keep_last=keep,
    )


def test_layout_latest_and_round_trip(tmp_path):
    m = _model(1)
    path = _save(tmp_path, 7, m)
    assert path == tmp_path / "checkpoints" / "step-000007"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000007"
    names = {p.name for p in path.iterdir()}
    assert names == {"model.safetensors", "optimizer-rank00000.safetensors", "rng-rank00000.pt",
                     "trainer.pt", "plan.yaml", "meta.json"}
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 7 and meta["world_size"] == 1 and "meta.json" not in meta["files"]
    info = ck.resolve_checkpoint(tmp_path)  # the run folder resolves to its newest checkpoint
    assert info.path == path and info.step == 7
    m2 = _model(2)
    ck.load_model_weights(info, m2)
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert m2[1].weight is m2[0].weight
    assert torch.equal(ck.load_optimizer(info, "optimizer-rank00000.safetensors")["state"]["x"], torch.arange(3))


def test_rng_round_trip():
    torch.manual_seed(3); random.seed(3)
    state = ck.capture_rng()
    a = (torch.rand(3), random.random())
    ck.restore_rng(state)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def test_a_run_seeds_every_rng_its_checkpoint_saves():
    """Two runs of one plan start from the same state of every RNG a checkpoint saves (torch,
    random, numpy): otherwise their ``rng-rank*.pt`` differ, and so would any draw from them."""
    import numpy as np

    from zfctl.plan.resolve import resolve_plan
    from zfctl.train.dist import DistEnv, process_setup

    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.device=cpu"])
    states = []
    for noise in (1, 2):
        np.random.seed(noise); random.seed(noise); torch.manual_seed(noise)  # whatever came before
        with process_setup(plan, DistEnv(), torch.device("cpu")):
            states.append(ck.capture_rng())
    a, b = states
    assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]
    assert a["numpy"]["pos"] == b["numpy"]["pos"] and torch.equal(a["numpy"]["keys"], b["numpy"]["keys"])


def test_rotation_keeps_last_k_and_ignores_abandoned_future(tmp_path):
    for s in (2, 4, 6, 8):
        _save(tmp_path, s, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000006", "step-000008"]
    # Resumed from step 6: the step-8 folder is the abandoned timeline; saving step 7 keeps it
    # (rotation only counts checkpoints up to the newest one) and `latest` points at step 7.
    _save(tmp_path, 7, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000006", "step-000007", "step-000008"]
    assert ck.resolve_checkpoint(tmp_path).step == 7
    assert ck.resolve_checkpoint(tmp_path, latest_good=True).step == 7  # not the abandoned step 8
    _save(tmp_path, 8, keep=2)  # replaces the abandoned step-8 folder
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000007", "step-000008"]


def test_stale_tmp_is_ignored_and_cleared(tmp_path):
    _save(tmp_path, 2)
    stale = tmp_path / "checkpoints" / ".tmp-step-000004"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    assert ck.resolve_checkpoint(tmp_path).step == 2
    _save(tmp_path, 4)
    assert not stale.exists() and ck.resolve_checkpoint(tmp_path).step == 4


def test_missing_pointer_falls_back_to_newest_valid(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    root = tmp_path / "checkpoints"
    (root / "latest").unlink()
    (root / "step-000004" / "meta.json").unlink()  # incomplete: never valid
    assert ck.resolve_checkpoint(tmp_path).step == 2


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "meta.json").unlink(), "meta.json is missing"),
    (lambda p: (p / "meta.json").write_text("{not json"), "meta.json is corrupt"),
    (lambda p: (p / "trainer.pt").unlink(), "trainer.pt is missing"),
    (lambda p: (p / "model.safetensors").write_bytes(b"xx"), "model.safetensors has 2 bytes"),
])
def test_damaged_checkpoint_is_a_one_line_user_error(tmp_path, damage, message):
    path = _save(tmp_path, 3)
    damage(path)
    with pytest.raises(UserError, match=message) as e:
        ck.read_checkpoint(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_nonexistent_and_empty_paths(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ck.resolve_checkpoint(tmp_path / "nope")
    with pytest.raises(UserError, match="no readable checkpoint"):
        ck.resolve_checkpoint(tmp_path)


def test_a_resume_launcher_resolves_once_and_hands_its_ranks_the_folder(tmp_path, monkeypatch):
    """``resume --nproc 2 --latest-good``: the launcher resolves (and verifies) the checkpoint once
    and the ranks load that folder (RESUME_FROM_ENV) instead of hashing the run folder again."""
    from zfctl.train import launch
    from zfctl.train.dist import RESUME_FROM_ENV

    for s in (2, 4):
        _save(tmp_path, s)
    calls, launched = [], []
    real = ck.resolve_checkpoint
    monkeypatch.setattr(ck, "resolve_checkpoint", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(launch, "under_torchrun", lambda: False)
    monkeypatch.setattr(launch, "relaunch", lambda n, argv, extra_env=None: launched.append((n, extra_env)) or 0)
    monkeypatch.setattr(launch, "_saved_world_size", lambda info, nproc, strategy=None: info.world_size)
    launch.resume(tmp_path, max_steps=None, allow_changes=False, latest_good=True, nproc=2,
                  argv=["resume", str(tmp_path), "--latest-good", "--nproc", "2"], show_plan=print)
    assert len(calls) == 1
    assert launched == [(2, {RESUME_FROM_ENV: str(tmp_path / "checkpoints" / "step-000004")})]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_note_about_the_loaded_optimizer_state_is_one_note_line_on_rank_0(monkeypatch, rank: int) -> None:
    """What the engine says about a loaded state (``StateNote``: e.g. a state of the per-step clip
    rule, zfctl/offload/cpu/pipeline.py) reaches the console as one ``note:`` line, on rank 0 only;
    any other warning of the load is shown as Python shows it."""
    import warnings

    from zfctl.offload.cpu.pipeline import StateNote
    from zfctl.train import progress

    def load(*a, **k):
        warnings.warn("the saved steps count as unclipped", StateNote, stacklevel=2)
        warnings.warn("something else", RuntimeWarning, stacklevel=2)

    monkeypatch.setattr(progress, "load_optimizer_state", load)
    monkeypatch.setattr(progress, "restore_scheduler", lambda *a: None)
    restore = progress.Restore(checkpoint=None, sampler=None, scheduler={}, rng=None)  # type: ignore[arg-type]
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        restore.install(None, None, rank=rank, world_size=2, note=notes.append)  # type: ignore[arg-type]
    assert notes == (["the saved steps count as unclipped"] if rank == 0 else [])
    assert [str(w.message) for w in shown] == ["something else"]
