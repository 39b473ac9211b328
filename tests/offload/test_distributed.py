"""Data-parallel ZenFlow on CPU with gloo: 2 ranks == 1 rank, host state halved, exact resume,
state saved on 2 ranks continued on 1 (and the reverse): host state is keyed by name and range,
and the bytes each rank sends.

Two processes (torch.multiprocessing.spawn, loopback rendezvous on a free port) each train a
tiny MLP on their half of every global batch; the single-process reference trains on the same
two halves as two accumulated micro-batches (loss / 2 each) in the test process. The exchange
sums the halves' gradients and divides by 2, which gives the bits of g0/2 + g1/2: only the clip
norm's summation order (partial sums per owner, zfctl/offload/parallel/exchange.py) differs, by rounding.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from proc_helpers import rendezvous, spawn_ranks
from test_offload_helpers import zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.parallel.pieces import merge_states
from zfctl.offload.state import FORMAT_V1

STEPS, BATCH = 20, 8
CASES = {
    # ZenFlow with overlap: warm-up, selection at 1 and re-selection at 7 (state migrates between
    # partitions), CPU updates installed one interval late and broadcast by their owners.
    "zenflow": {
        "topk_ratio": 0.25,
        "update_interval": 3,
        "overlap_step": True,
        "select_interval": 6,
        "full_warm_up_rounds": 1,
    },
    # The same without overlap: every CPU update installed (and broadcast) at its own boundary.
    "zenflow-sync": {
        "topk_ratio": 0.25,
        "update_interval": 3,
        "overlap_step": False,
        "select_interval": 6,
        "full_warm_up_rounds": 1,
    },
    # The auto interval reads each matrix's gradient L1 mass, which no rank holds whole.
    "auto-interval": {
        "topk_ratio": 0.25,
        "update_interval": "auto",
        "overlap_step": True,
        "select_interval": 6,
        "full_warm_up_rounds": 1,
    },
    # The first and last Linear split by row (zenflow.vocab_select: rows): partitions, selections
    # and installs cut their rows, not their columns; each update lands one step after its
    # boundary (install_lag 1: mid-interval installs, broadcast by their owners).
    "by-row-lag1": {
        "topk_ratio": 0.25,
        "update_interval": 3,
        "overlap_step": True,
        "select_interval": 6,
        "full_warm_up_rounds": 1,
        "vocab_select": "rows",
        "install_lag": 1,
    },
    "zero-offload": {
        "topk_ratio": 0.0,
        "update_interval": 1,
        "overlap_step": False,
        "full_warm_up_rounds": 0,
    },
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 24),
        torch.nn.Tanh(),
        torch.nn.Linear(24, 8),
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, BATCH, 16, generator=g), torch.randn(STEPS, BATCH, 8, generator=g)


def _optimizer(model: torch.nn.Module, case: str, group) -> ZenFlowOptimizer:
    cfg = zen(**CASES[case], cpu_threads=1, pin_memory=False)
    return ZenFlowOptimizer(
        model.named_parameters(), cfg, lr=2e-2, weight_decay=0.01, max_grad_norm=0.5, process_group=group,
        vocab_params=["0.weight", "4.weight"],  # by row only where the case says vocab_select: rows
    )


def _steps(model, opt, rank: int, world: int, lo: int, hi: int) -> list:
    """Steps ``lo..hi``: with 2 ranks each takes its half of the batch; alone, the two halves are
    two accumulated micro-batches. Returns the StepStats."""
    x, y = _data()
    per, stats = BATCH // 2, []
    for t in range(lo, hi):
        for half in (rank,) if world == 2 else (0, 1):
            xs, ys = x[t, half * per : (half + 1) * per], y[t, half * per : (half + 1) * per]
            (F.mse_loss(model(xs), ys) / (2 // world)).backward()
        stats.append(opt.step())
        opt.zero_grad(set_to_none=True)
    return stats


def _train(case: str, rank: int = 0, world: int = 1, group=None) -> tuple[dict, int, list]:
    model = _model()
    with _optimizer(model, case, group) as opt:
        stats = _steps(model, opt, rank, world, 0, STEPS)
        opt.flush()
        host = opt.host.master.numel() if opt.host is not None else 0
    steps = [(s.comm_bytes, s.boundary, s.selection, s.warmup, s.installed) for s in stats]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, host, steps


def _resumed(case: str, rank: int, world: int, group, at: int, out: Path | None = None) -> dict:
    """``at`` steps, state_dicts (mid-interval, update in flight), a fresh model+optimizer, the rest.
    ``out``: also save this rank's state there (``state-rank{rank}.pt``) for a resume elsewhere."""
    model = _model()
    with _optimizer(model, case, group) as opt:
        _steps(model, opt, rank, world, 0, at)
        msd = {k: v.clone() for k, v in model.state_dict().items()}
        osd = opt.state_dict()
        assert opt.pipeline.pending_install or opt.pipeline.interval_len > 0  # an interval is open
    if out is not None:
        torch.save({"model": msd, "opt": osd}, out / f"state-rank{rank}.pt")
    return _continue(case, rank, world, group, msd, [osd], at)


def _continue(case: str, rank: int, world: int, group, msd: dict, saved: list[dict], at: int) -> dict:
    """A fresh model+optimizer loaded from ``msd`` and the saved ranks' optimizer states (any
    world size: each rank takes the pieces it needs), trained from step ``at`` to the end."""
    model = _model()
    model.load_state_dict(msd)
    with _optimizer(model, case, group) as opt:
        opt.load_state_dict(merge_states(saved, opt.host_ranges()))
        _steps(model, opt, rank, world, at, STEPS)
        opt.flush()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def _buckets(nbytes: int):
    from zfctl.offload.parallel import partition, rounds

    saved = partition.BUCKET_BYTES
    partition.BUCKET_BYTES = rounds.BUCKET_BYTES = nbytes  # the exchange plans through rounds.py
    try:
        yield
    finally:
        partition.BUCKET_BYTES = rounds.BUCKET_BYTES = saved


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        res = {case: _train(case, rank, world, dist.group.WORLD) for case in CASES}
        # Buckets of 1 KiB: the reduce-scatter and the install broadcasts run in many rounds, some
        # with an empty segment for one owner (every bucket size must give the same numbers).
        with _buckets(1024):
            res["small-buckets"] = _train("zenflow", rank, world, dist.group.WORLD)
        res["resumed"] = _resumed("zenflow", rank, world, dist.group.WORLD, at=10, out=Path(out))
        # A one-process state at step 10, continued on 2 ranks (each takes its columns).
        one = torch.load(Path(out) / "one.pt", weights_only=True)
        res["from_one"] = _continue("zenflow", rank, world, dist.group.WORLD, one["model"], [one["opt"]], 10)
        model = _model()
        with _optimizer(model, "zenflow", dist.group.WORLD) as opt:
            _steps(model, opt, rank, world, 0, 2)
            sd = opt.state_dict()
            # Pieces that miss this rank's columns: refused, naming the matrix and the ranges.
            res["gap"] = _refusal(opt, {**sd, "host": sd["host"][1:]})
            # The flat per-rank format of older versions cannot be re-cut: refused, naming both ranks.
            res["refused"] = _refusal(opt, {**sd, "format": FORMAT_V1, "partition": {**sd["partition"], "rank": 1 - rank}})
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _refusal(opt: ZenFlowOptimizer, sd: dict) -> str:
    try:
        opt.load_state_dict(sd)
    except ValueError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dist")
    model = _model()  # the one-process state the ranks continue from (test_one_rank_state_continues_on_two)
    with _optimizer(model, "zenflow", None) as opt:
        _steps(model, opt, 0, 1, 0, 10)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out / "one.pt")
    spawn_ranks(_worker, 2, (2, rendezvous(out), str(out)), timeout=240, what="2-rank training")
    return [{**torch.load(out / f"rank{r}.pt", weights_only=False), "dir": out} for r in range(2)]


def _rel_err(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_rank(two_ranks, case):
    ref = _train(case)[0]
    init = _model().state_dict()
    assert _rel_err(ref, init) > 1e-2  # training moved the weights: the comparison has teeth
    for r in range(2):
        assert _rel_err(two_ranks[r][case][0], ref) <= 1e-6, (case, r)
    for k in ref:  # the replicas agree bit for bit: same averaged gradient, same broadcast columns
        assert torch.equal(two_ranks[0][case][0][k], two_ranks[1][case][0][k]), k


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_host_state_is_partitioned(two_ranks, case):
    total = _train(case)[1]
    matrices = sum(p.numel() for p in _model().parameters() if p.dim() == 2)
    assert total == matrices  # one process: every matrix element has host state
    n0, n1 = (two_ranks[r][case][1] for r in range(2))
    assert n0 + n1 == total
    widest = 32  # rows of the tallest matrix: a cut moves by at most half a column
    assert abs(n0 - total / 2) <= widest / 2 and abs(n1 - total / 2) <= widest / 2, (n0, n1, total)


def test_comm_bytes_follow_the_ring_model(two_ranks):
    """Bytes sent per step (StepStats.comm_bytes, ring model of zfctl/offload/parallel/partition.py), for
    the two ranks together. A plain step (selection made, no install): the replicated elements
    (biases, selected columns) all-reduced, 2 (W-1)/W of their bytes on each rank; the host
    columns reduce-scattered to their owners, each rank sending the other's share, so together
    the ranks send them once; one 4-byte all-reduce of the norm's partial sums. An install adds
    each owner's broadcast of its host columns, (W-1)/W of them counted on each rank."""
    params = list(_model().parameters())
    mats = [p for p in params if p.dim() == 2]
    dense = sum(p.numel() for p in params if p.dim() < 2)
    selected = sum(math.floor(0.25 * p.shape[1]) * p.shape[0] for p in mats)
    host = sum(p.numel() for p in mats) - selected
    plain = 2 * (dense + selected) * 4 + host * 4 + 2 * 4
    seen = set()
    for case in ("zenflow", "zenflow-sync"):
        for a, b in zip(two_ranks[0][case][2], two_ranks[1][case][2], strict=True):
            sent, _boundary, selection, warm, installed = a
            assert b[1:] == a[1:]  # the ranks agree on what each step did
            if warm or selection:
                continue
            assert sent + b[0] == plain + (host * 4 if installed else 0), (case, a, b)
            seen.add(installed)
    assert seen == {False, True}
    # Against a full gradient all-reduce on every step (2 (W-1)/W of all bytes per rank):
    full = sum(p.numel() for p in params) * 4
    assert plain / 2 <= 0.65 * full, (plain / 2, full)


def test_bucket_size_changes_nothing_but_the_rounds(two_ranks):
    ref = _train("zenflow")[0]
    for r in range(2):
        small, big = two_ranks[r]["small-buckets"], two_ranks[r]["zenflow"]
        assert _rel_err(small[0], ref) <= 1e-6, r
        assert [s[0] for s in small[2]] == [s[0] for s in big[2]]  # the same bytes, in more collectives


def test_rounds_cover_each_owners_host_columns_once():
    """plan_rounds: every non-selected column of every owner's range lands in exactly one round,
    in slot and column order, and no owner's share of a round exceeds BUCKET_BYTES / W."""
    from zfctl.offload.layout import plan_layout
    from zfctl.offload.parallel.partition import partition_layout
    from zfctl.offload.parallel.rounds import plan_rounds

    layout = plan_layout(list(_model().named_parameters()), 0.25)
    index = [torch.tensor([0, 5, 9, 15]) if s.selects and s.cols == 16 else None for s in layout.slots]
    index = [torch.arange(0, s.cols, 4) if s.selects and s.cols == 32 else i for s, i in zip(layout.slots, index)]
    for world in (2, 3):
        local, part = partition_layout(layout, None, 0, world)
        with _buckets(1024):
            rounds = plan_rounds(part, local, index, 4, torch.device("cpu"))
        assert len(rounds) > 3 and all(len(rnd) == world for rnd in rounds)
        for owner in range(world):
            assert all(sum(u.numel for u in rnd[owner]) <= 1024 // world // 4 for rnd in rounds)
            got = [(u.slot.index, int(c)) for rnd in rounds for u in rnd[owner] for c in u.ids]
            want = [(pc.index, c) for pc in part.pieces if pc.owner == owner for c in range(pc.c0, pc.c1)
                    if index[pc.index] is None or c not in index[pc.index].tolist()]
            assert got == want, (world, owner)


@pytest.mark.slow
def test_two_rank_resume_is_exact(two_ranks):
    for r in range(2):
        straight, resumed = two_ranks[r]["zenflow"][0], two_ranks[r]["resumed"]
        for k in straight:
            assert torch.equal(straight[k], resumed[k]), (r, k)


@pytest.mark.slow
def test_two_rank_state_continues_on_one_rank(two_ranks):
    """Saved mid-interval on 2 ranks (update in flight), resumed on 1: each piece of host state is
    found by name and column range; the rest of the run matches the uninterrupted 2-rank run."""
    saved = [torch.load(two_ranks[0]["dir"] / f"state-rank{r}.pt", weights_only=True) for r in range(2)]
    ranges = [[(p["name"], p["c0"], p["c1"]) for p in s["opt"]["host"]] for s in saved]
    assert ranges[0] and ranges[1] and not set(ranges[0]) & set(ranges[1])  # two halves, keyed by name
    resumed = _continue("zenflow", 0, 1, None, saved[0]["model"], [s["opt"] for s in saved], 10)
    assert _rel_err(resumed, two_ranks[0]["zenflow"][0]) <= 1e-5


@pytest.mark.slow
def test_one_rank_state_continues_on_two_ranks(two_ranks):
    ref = _train("zenflow")[0]
    for r in range(2):
        assert _rel_err(two_ranks[r]["from_one"], ref) <= 1e-5, r
        for k in ref:  # both ranks hold the same replica
            assert torch.equal(two_ranks[r]["from_one"][k], two_ranks[0]["from_one"][k]), k


@pytest.mark.slow
def test_uncovered_columns_and_old_format_from_another_rank_are_refused(two_ranks):
    for r in range(2):
        assert "optimizer state lacks columns of" in two_ranks[r]["gap"] and "this process holds" in two_ranks[r]["gap"]
        msg = two_ranks[r]["refused"]
        assert f"rank {1 - r}'s slice" in msg and f"this is rank {r} of 2" in msg, msg
        assert "resume with 2 process(es)" in msg, msg


def test_worker_argv_keeps_nproc_away_from_torchrun():
    from zfctl.train.dist import torchrun_command, worker_argv

    argv = ["finetune", "m", "--nproc", "2", "--set", "a=1", "--nproc=3"]
    assert worker_argv(argv, "distributed.nproc") == ["finetune", "m", "--set", "a=1",
                                                      "--set", "distributed.nproc=3"]
    assert worker_argv(["resume", "run", "--nproc", "2"]) == ["resume", "run"]
    cmd = torchrun_command(2, ["resume", "run"])
    assert cmd[1:6] == ["-m", "zfctl.train._torchrun", "--standalone", "--nproc-per-node=2", "-m"]
    assert cmd[6:] == ["zfctl", "resume", "run"]


def test_errors_name_the_rank_only_when_distributed():
    from zfctl.errors import UserError
    from zfctl.train.dist import DistEnv, rank_error

    e = UserError("data.path: no such file")
    assert rank_error(e, DistEnv()) is e
    named = rank_error(e, DistEnv(rank=3, world_size=4, local_rank=1))
    assert isinstance(named, UserError) and str(named) == "rank 3: data.path: no such file"


GLOO_GONE = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                         "by peer [127.0.0.1]:25776. This is typically caused by a remote worker crashing. Check the "
                         "logs of the remote worker for more details.\nGLHF")


def test_a_collective_failing_on_a_lost_peer_is_one_line_and_a_bug_keeps_its_traceback(monkeypatch):
    from zfctl.errors import RunFailed
    from zfctl.train import signals
    from zfctl.train.dist import DistEnv, rank_error

    # A process that received no stop signal: in-process runs of other tests may have had one.
    monkeypatch.setattr(signals, "_received", None)

    env = DistEnv(rank=0, world_size=2)
    out = rank_error(GLOO_GONE, env)
    assert isinstance(out, RunFailed) and out.exit_code == 1
    assert str(out).startswith("rank 0: stopped because another process of this job ended") and "\n" not in str(out)
    assert "the collective reported: connection closed by peer)" in str(out)
    assert "pair.cc" not in str(out) and "remote w" not in str(out)  # the backend's words, not a cut-off copy
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert rank_error(bug, env) is bug
    assert rank_error(GLOO_GONE, DistEnv()) is GLOO_GONE  # one process: there is no peer to lose


def test_a_lost_peer_names_the_run_folder_and_its_checkpoint_and_corrects_a_stop_announcement(
        tmp_path, monkeypatch: pytest.MonkeyPatch):
    from zfctl.train import signals
    from zfctl.train.dist import DistEnv, rank_error

    env, run = DistEnv(rank=0, world_size=2), tmp_path / "run"
    line = str(rank_error(GLOO_GONE, env, run_dir=run))
    assert "RUN_DIR" not in line and line.endswith(f"{run} has no checkpoint yet: once that is fixed, start the run again")
    step = run / "checkpoints" / "step-000006"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 6, "world_size": 2, "files": {}}))
    (run / "checkpoints" / "latest").write_text("step-000006\n")
    line = str(rank_error(GLOO_GONE, env, run_dir=run))
    assert line.endswith(f"continue from its checkpoint of step 6 with `zfctl resume {run}`"), line
    # torchrun SIGTERMs the survivor, which announced "writing a checkpoint": the line corrects it
    monkeypatch.setattr(signals, "_received", 15)
    line = str(rank_error(GLOO_GONE, env, run_dir=run))
    assert line.startswith("rank 0: the stop checkpoint was not written: another process of this job ended first")


def _bucket_worker(rank: int, init: str, out: str) -> None:
    from zfctl.offload.parallel import partition

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        partition.BUCKET_BYTES = 64  # 16 fp32: the 20-element tensor is a bucket of its own
        big = torch.full((4, 5), float(rank + 1))
        small = [torch.full((3,), 10.0 * (rank + 1)), torch.full((2, 2), 100.0 * (rank + 1))]
        buckets = partition.launch_buckets([big, *small], dist.group.WORLD)
        shape = [(b.in_place, len(b.tensors), b.flat.data_ptr() == big.data_ptr()) for b in buckets]
        partition.finish_buckets(buckets, 2, divide=True)
        torch.save({"shape": shape, "big": big, "small": small}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_bucket_of_one_tensor_is_reduced_in_place_and_the_others_through_one_flat_copy(tmp_path: Path) -> None:
    spawn_ranks(_bucket_worker, 2, (rendezvous(tmp_path), str(tmp_path)), timeout=120, what="2 gloo ranks")
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert res["shape"] == [(True, 1, True), (False, 2, False)]
        assert torch.equal(res["big"], torch.full((4, 5), 1.5))  # the mean of 1 and 2, in the tensor itself
        assert torch.equal(res["small"][0], torch.full((3,), 15.0))
        assert torch.equal(res["small"][1], torch.full((2, 2), 150.0))
