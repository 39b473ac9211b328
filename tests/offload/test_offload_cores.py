"""The core split (zfctl/offload/cpu/cores.py): reserved cores, pinned pools per local rank, NUMA.

The planning is pure: machines here are fake sysfs trees and fake allowed sets, so a 2-node,
hyperthreaded, 8-GPU node is checked on a 2-core CI machine. The pinning itself is checked with
the real native pools at the end.
"""

from __future__ import annotations

import os
import time
from itertools import combinations
from pathlib import Path

import pytest
import torch
from test_offload_helpers import batches, tiny_net, zen

from zfctl import _native as N
from zfctl.errors import ConfigError
from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer
from zfctl.offload.config import TuningConfig
from zfctl.offload.cpu import cores
from zfctl.offload.cpu.cores import Machine, parse_cpulist, plan_cores, read_machine


def fake_sysfs(root: Path, nodes: dict[int, str], smt: int = 1, gpus: dict[str, int] | None = None) -> Path:
    """A /sys with NUMA nodes (node -> cpulist), hyperthread siblings (with smt 2, CPU c and
    c + half are one core, as Linux numbers them on x86) and GPUs (PCI address -> numa_node)."""
    all_cpus = sorted(c for text in nodes.values() for c in parse_cpulist(text))
    half = len(all_cpus) // smt
    for n, text in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(text + "\n")
    for c in all_cpus:
        d = root / "devices" / "system" / "cpu" / f"cpu{c}" / "topology"
        d.mkdir(parents=True)
        core = c % half
        (d / "thread_siblings_list").write_text(",".join(str(core + k * half) for k in range(smt)) + "\n")
    for pci, node in (gpus or {}).items():
        d = root / "bus" / "pci" / "devices" / pci
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


def flat(n: int) -> Machine:
    """One NUMA node, n CPUs, no hyperthreads."""
    return Machine(tuple(range(n)), {0: tuple(range(n))}, {c: (c,) for c in range(n)})


def used(plan: cores.CorePlan) -> set[int]:
    return set(plan.training) | set(plan.update)


# -- one rank -----------------------------------------------------------------------------------
def test_gpu_run_reserves_cores_and_gives_the_update_the_rest() -> None:
    """Nothing runs native code on the host per step (the gradient slots): the CPU update's pool
    takes every core that is not reserved, on every gradient path."""
    plan = plan_cores(flat(16), gpu=0)
    assert plan.training == (0, 1)  # auto: 2 cores from 8 up
    assert plan.update == tuple(range(2, 16))
    assert plan.threads == 14 and plan.total == 14 and plan.pinned
    assert plan.node is None  # one node: nothing to place
    assert not set(plan.training) & set(plan.update)


def test_reservation_auto_by_share_size_and_none_on_the_cpu() -> None:
    assert [len(plan_cores(flat(n), gpu=0).training) for n in (1, 2, 3, 7, 8, 64)] == [0, 0, 1, 1, 2, 2]
    cpu = plan_cores(flat(16), gpu=None)
    assert cpu.training == () and cpu.threads == 16 and not cpu.pinned  # as before the split existed
    assert plan_cores(flat(16), gpu=None, pin="on").pinned


def test_explicit_reservation_is_clamped_to_leave_a_pool_core() -> None:
    assert plan_cores(flat(16), gpu=0, reserved=5).training == (0, 1, 2, 3, 4)
    plan = plan_cores(flat(4), gpu=0, reserved=9)
    assert plan.training == (0, 1, 2) and plan.update == (3,)
    assert any("reserved_cores 9" in note for note in plan.notes)


def test_cpu_threads_takes_the_first_pool_cpus_and_too_many_are_not_pinned() -> None:
    plan = plan_cores(flat(16), gpu=0, cpu_threads=6)
    assert plan.total == 6 and plan.update == (2, 3, 4, 5, 6, 7)
    over = plan_cores(flat(4), gpu=0, cpu_threads=8)
    assert not over.pinned and any("not pinned" in note for note in over.notes)
    one = plan_cores(flat(16), gpu=0, cpu_threads=1)
    assert one.update == (2,) and one.threads == 1


def test_a_single_process_honours_omp_num_threads_but_torchrun_ranks_do_not() -> None:
    cfg = ZenFlowConfig()
    single = cores.plan_for(cfg, torch.device("cpu"), machine=flat(8),
                            env={"OMP_NUM_THREADS": "1"})
    assert single.total == 1
    # torchrun sets OMP_NUM_THREADS=1 for every rank of a node: the local-rank split decides
    ranked = cores.plan_for(cfg, torch.device("cpu"), machine=flat(8),
                            env={"OMP_NUM_THREADS": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert ranked.share == (4, 5, 6, 7) and ranked.total == 4


# -- ranks of one node ---------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_local_ranks_never_share_a_cpu(world: int) -> None:
    plans = [plan_cores(flat(16), gpu=r, local_rank=r, local_world=world) for r in range(world)]
    for a, b in combinations(plans, 2):
        assert not set(a.share) & set(b.share)
    for p in plans:
        assert used(p) <= set(p.share) and p.update
    assert sorted(c for p in plans for c in p.share) == list(range(16))  # and every core is someone's


def test_a_restricted_process_splits_only_what_it_may_use() -> None:
    """taskset -c 4-7 torchrun --nproc 2: both ranks see CPUs 4-7 and take two each."""
    m = Machine((4, 5, 6, 7), {0: tuple(range(16))}, {c: (c,) for c in range(16)})
    a, b = (plan_cores(m, gpu=r, local_rank=r, local_world=2) for r in (0, 1))
    assert a.share == (4, 5) and b.share == (6, 7)
    assert a.training == () and a.threads == 2  # 2 cores: nothing reserved


def test_more_ranks_than_cpus_share_with_a_note() -> None:
    plans = [plan_cores(flat(2), gpu=r, local_rank=r, local_world=4) for r in range(4)]
    assert [p.share for p in plans] == [(0,), (1,), (0,), (1,)]
    assert all(any("share" in note for note in p.notes) for p in plans)


# -- hyperthreads and NUMA, from a fake sysfs ---------------------------------------------------
GPUS = {f"0000:{bus:02x}:00.0": node for bus, node in ((0x1B, 0), (0x3D, 0), (0x9A, 1), (0xBC, 1))}


def two_sockets(tmp_path: Path) -> Machine:
    """2 NUMA nodes x 8 cores x 2 threads: node 0 = CPUs 0-7 and their siblings 16-23; 4 GPUs,
    two on each node."""
    root = fake_sysfs(tmp_path, {0: "0-7,16-23", 1: "8-15,24-31"}, smt=2, gpus=GPUS)
    return read_machine(root, allowed=range(32), gpu_pci=list(GPUS))


def test_read_machine_parses_nodes_siblings_and_gpu_nodes(tmp_path: Path) -> None:
    m = two_sockets(tmp_path)
    assert m.nodes == {0: (*range(8), *range(16, 24)), 1: (*range(8, 16), *range(24, 32))}
    assert m.siblings[3] == (3, 19) and m.siblings[19] == (3, 19)
    assert m.gpu_nodes == (0, 0, 1, 1)
    assert parse_cpulist("0-2,5,7-8\n") == (0, 1, 2, 5, 7, 8) and parse_cpulist("") == ()
    assert cores.format_cpulist((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"


def test_one_node_machines_place_nothing_and_unknown_gpu_nodes_too(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path / "one", {0: "0-15"}, gpus={"0000:01:00.0": -1})
    m = read_machine(root, allowed=range(16), gpu_pci=["0000:01:00.0"])
    assert m.gpu_nodes == (None,) and plan_cores(m, gpu=0).node is None
    m2 = two_sockets(tmp_path / "two")
    unknown = Machine(m2.allowed, m2.nodes, m2.siblings, (None, None, None, None))
    assert plan_cores(unknown, gpu=0).node is None
    assert cores.pci_numa_node("0000:ff:00.0", tmp_path / "two") is None  # no such device


def test_each_rank_uses_its_gpus_node_and_whole_cores(tmp_path: Path) -> None:
    m = two_sockets(tmp_path)
    plans = [plan_cores(m, gpu=r, local_rank=r, local_world=4) for r in range(4)]
    assert [p.node for p in plans] == [0, 0, 1, 1] and [p.gpu_node for p in plans] == [0, 0, 1, 1]
    for p in plans:
        assert set(p.share) <= set(m.nodes[p.node])  # pools on the GPU's node
    assert plans[0].share == (0, 1, 2, 3, 16, 17, 18, 19)  # 4 of node 0's 8 cores, both threads each
    assert plans[1].share == (4, 5, 6, 7, 20, 21, 22, 23)
    # whole cores: a reserved CPU's sibling is reserved too, never the pool's
    sib = m.siblings
    for p in plans:
        assert all(set(sib[c]) <= set(p.training) for c in p.training)
        assert not any(set(sib[c]) & set(p.update) for c in p.training)
    for a, b in combinations(plans, 2):
        assert not set(a.share) & set(b.share)
    assert plans[0].training == (0, 16) and plans[0].update == (1, 2, 3, 17, 18, 19)  # 4 cores: 1 reserved
    alone = plan_cores(m, gpu=0)  # one rank: node 0's 8 cores, 2 reserved, 12 CPUs for the pool
    assert alone.update == (2, 3, 4, 5, 6, 7, 18, 19, 20, 21, 22, 23) and alone.threads == 12


def test_gpu_node_outside_the_allowed_cpus_is_not_placed(tmp_path: Path) -> None:
    m = two_sockets(tmp_path)
    only0 = Machine(tuple(m.nodes[0]), m.nodes, m.siblings, m.gpu_nodes)
    plan = plan_cores(only0, gpu=2)  # GPU 2 is on node 1, the process may run on node 0 only
    assert plan.node is None and set(plan.share) == set(m.nodes[0])
    assert any("may not run there" in note for note in plan.notes)


def test_unknown_peers_split_by_every_local_rank(tmp_path: Path) -> None:
    """CUDA_VISIBLE_DEVICES per rank: each rank sees one GPU, so which ranks share its node is
    unknown; ranks then split by local rank over all of them (never the same CPUs, maybe fewer)."""
    m = two_sockets(tmp_path)
    per_rank = [Machine(m.allowed, m.nodes, m.siblings, (node,)) for node in (0, 0, 1, 1)]
    plans = [plan_cores(per_rank[r], gpu=0, local_rank=r, local_world=4) for r in range(4)]
    for a, b in combinations(plans, 2):
        assert not set(a.share) & set(b.share)


# -- configuration ------------------------------------------------------------------------------
def test_tuning_keys_are_validated() -> None:
    for key, bad in (("reserved_cores", -1), ("reserved_cores", "some"), ("pin_threads", "yes")):
        with pytest.raises(ConfigError, match=f"zenflow.tuning.{key}"):
            ZenFlowConfig(tuning=TuningConfig(**{key: bad})).validate()
    ok = ZenFlowConfig(tuning=TuningConfig(reserved_cores=3, pin_threads="on")).validate()
    assert (ok.tuning.reserved_cores, ok.tuning.pin_threads) == (3, "on")


# -- placement and pinning, for real --------------------------------------------------------------
def test_on_node_runs_the_allocating_thread_there_and_gives_its_cpus_back() -> None:
    before = os.sched_getaffinity(0)
    target = (min(before),)
    plan = cores.CorePlan(target, (), target, 1, 1, False, 0, 0, 2)
    with cores.on_node(plan):
        assert os.sched_getaffinity(0) == set(target)
    assert os.sched_getaffinity(0) == before
    nothing = cores.CorePlan(target, (), target, 1, 1, False, None, None, 1)
    with cores.on_node(nothing):
        assert os.sched_getaffinity(0) == before


def test_bind_host_binds_every_buffer_to_the_node_and_reports_a_refusal() -> None:
    calls = []

    class Fake:
        def __init__(self, err: int) -> None:
            self.err = err

        def bind_node(self, t: torch.Tensor, node: int) -> int:
            calls.append((t.data_ptr(), node))
            return self.err

    bufs = [torch.zeros(8) for _ in range(3)]
    placed = cores.CorePlan((0,), (), (0,), 1, 1, False, 1, 1, 2)
    assert cores.bind_host(placed, Fake(0), bufs) == []
    assert calls == [(b.data_ptr(), 1) for b in bufs]
    assert "refused" in cores.bind_host(placed, Fake(1), bufs)[0]
    calls.clear()
    one_node = cores.CorePlan((0,), (), (0,), 1, 1, False, None, None, 1)
    assert cores.bind_host(one_node, Fake(0), bufs) == [] and calls == []
    # and the real call on this machine's node 0 (a no-op move: one node) is accepted
    assert N.bind_node(torch.ones(1 << 16), 0) in (0, 1)  # 1 = EPERM where a sandbox forbids mbind


def settle(pool: int, want: int, acc: torch.Tensor, x: torch.Tensor) -> tuple[int, ...]:
    """Calls into ``pool`` until its first worker reports ``want``: a worker applies a new CPU list
    when it wakes, and a call does not wait for a worker that woke after the caller took every
    tile (native/pool.c), so one call may return before the worker moved."""
    deadline = time.monotonic() + 30
    while True:
        N.accumulate(acc, x)
        got = N.pool_worker_cpus(pool)
        if (got and got[0] == want) or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def test_pinned_pool_workers_run_on_their_cpus_and_the_caller_gets_its_own_back() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    before_threads, before_mask = N.get_num_threads(), os.sched_getaffinity(0)
    acc, x = torch.zeros(1 << 20), torch.ones(1 << 20)
    try:
        N.set_num_threads(2)
        N.set_pool_cpus(0, [cpus[1], cpus[0]])  # the caller on cpus[1], worker 1 on cpus[0]
        assert N.pool_cpus(0) == (cpus[1], cpus[0])
        assert settle(0, cpus[0], acc, x)[0] == cpus[0]  # >= 512K elements: the pool runs it
        assert os.sched_getaffinity(0) == before_mask
        N.set_pool_cpus(0, [])
        assert N.pool_cpus(0) == () and settle(0, -1, acc, x)[0] == -1
        calls = int(acc[0])
        assert torch.equal(acc, torch.full_like(acc, calls))  # every tile of every call ran
    finally:
        N.set_pool_cpus(0, [])
        N.set_num_threads(before_threads)
    for bad in ([-1], [1 << 20], [True]):
        with pytest.raises(ValueError, match="set_pool_cpus"):
            N.set_pool_cpus(0, bad)
    with pytest.raises(ValueError, match="pool must be 0 or 1"):
        N.set_pool_cpus(2, [0])


def test_the_optimizer_pins_its_pools_to_the_plan() -> None:
    """pin_threads on: the optimizer applies the plan; the update's workers end up on its CPUs."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    cfg = zen(topk_ratio=0.1, update_interval=2, full_warm_up_rounds=0, cpu_threads=2, pin_threads="on")
    plan = cores.plan_for(cfg, torch.device("cpu"))
    before = N.get_num_threads()
    model = tiny_net()
    try:
        with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-2) as opt:
            assert opt.threads == plan.threads
            assert N.pool_cpus(0) == plan.update
            for x, y in batches(3):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    finally:
        N.set_pool_cpus(0, [])
        N.set_pool_cpus(1, [])
        N.set_num_threads(before)
