"""The binding's guard rails (bad arguments never reach C) and the thread pool's behaviour."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from zfctl import _native as N

HP = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}


def _bufs(n: int = 64):
    return torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda b: (b[0].double(), *b[1:]), r"^param: dtype must be float32, got float64"),
        (lambda b: (b[0], b[1].to(torch.int32), *b[2:]), r"^grad: dtype must be float32/bfloat16/float16"),
        (lambda b: (b[0], b[1][:-1], *b[2:]), r"^grad: has 63 elements, expected 64"),
        (lambda b: (b[0], b[1], b[2].half(), b[3]), r"^exp_avg: dtype must be float32"),
        (lambda b: (b[0], b[1], b[2], b[3].view(8, 8).t()), r"^exp_avg_sq: must be contiguous"),
        (lambda b: (b[0], b[1].to("meta"), *b[2:]), r"^grad: must be a CPU tensor, got device meta"),
        (lambda b: (b[0], b[1], b[0], b[3]), r"^exp_avg and param overlap in memory|^param and exp_avg overlap"),
    ],
)
def test_bad_buffers_raise_naming_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        N.adamw_step(*change(_bufs()), **HP)


def test_non_tensor_is_a_type_error():
    p, g, m, v = _bufs()
    with pytest.raises(TypeError, match=r"^param: expected a torch.Tensor, got list"):
        N.adamw_step(p.tolist(), g, m, v, **HP)


def test_bad_out_step_and_runs():
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match=r"^out: dtype must be bfloat16/float16, got float32"):
        N.adamw_step(p, g, m, v, out=torch.empty(64), **HP)
    with pytest.raises(ValueError, match=r"^out: has 32 elements, expected 64"):
        N.adamw_step(p, g, m, v, out=torch.empty(32, dtype=torch.bfloat16), **HP)
    with pytest.raises(ValueError, match=r"^step: must be an integer >= 1"):
        N.adamw_step(p, g, m, v, **{**HP, "step": 0})
    bad_runs = {
        "unsorted": ([[10, 2], [0, 2]], r"^runs\[1\] = \(0, 2\)"),
        "overlapping": ([[0, 5], [4, 2]], r"^runs\[1\] = \(4, 2\)"),
        "past the end": ([[60, 5]], r"^runs\[0\] = \(60, 5\).*buffer of 64 elements"),
        "negative length": ([[0, -1]], r"^runs\[0\] = \(0, -1\)"),
        "negative offset": ([[-1, 1]], r"^runs\[0\] = \(-1, 1\)"),
        "huge length": ([[1, 2**62]], r"^runs\[0\]"),
    }
    for rows, match in bad_runs.values():
        with pytest.raises(ValueError, match=match):
            N.accumulate(p, g, runs=torch.tensor(rows))
    with pytest.raises(ValueError, match=r"^runs: must have shape \[n, 2\]"):
        N.sq_norm(p, runs=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"^runs: dtype must be int64"):
        N.sq_norm(p, runs=torch.tensor([[0, 4]], dtype=torch.int32))
    assert torch.equal(m, torch.zeros(64))  # nothing was written by the failed calls


def test_isa_and_thread_controls():
    assert N.isa() == N.available_isas()[-1]  # the best path is the default
    assert "scalar" in N.available_isas()
    with pytest.raises(ValueError, match="unknown path 'sse9'"):
        N.set_isa("sse9")
    before = N.get_num_threads()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            N.set_num_threads(bad)
    N.set_num_threads(3)
    assert N.get_num_threads() == 3
    N.set_num_threads(before)


def test_concurrent_callers_get_correct_results():
    """Two Python threads in the library at once (the CPU worker's AdamW and the main thread's
    accumulation): one uses the pool, the other runs on its own thread; both are exact."""
    n = 600_000  # above the 512K elements where calls start using the pool
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(n, generator=gen)
    ref_p, ref_m, ref_v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    p, m, v = ref_p.clone(), ref_m.clone(), ref_v.clone()
    acc, ref_acc = torch.zeros(n), torch.zeros(n)
    for step in range(1, 21):
        N.adamw_step(ref_p, g, ref_m, ref_v, **{**HP, "step": step})
        N.accumulate(ref_acc, g, scale=0.5)

    def adam_worker():
        for step in range(1, 21):
            N.adamw_step(p, g, m, v, **{**HP, "step": step})

    before = N.get_num_threads()
    N.set_num_threads(2)
    worker = threading.Thread(target=adam_worker)
    worker.start()
    for _ in range(20):
        N.accumulate(acc, g, scale=0.5)
    worker.join()
    N.set_num_threads(before)
    assert torch.equal(p, ref_p) and torch.equal(m, ref_m) and torch.equal(v, ref_v)
    assert torch.equal(acc, ref_acc)


def test_thread_role_is_per_thread_and_validated():
    before = N.get_num_threads()
    N.set_num_threads(4)
    seen = {}

    def other():
        N.set_thread_role(1, 1)
        seen["other"] = (N.thread_pool(), N.thread_limit())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["other"] == (1, 1)
    assert (N.thread_pool(), N.thread_limit()) == (0, 4)  # this thread is untouched
    N.set_thread_role(0, 9)
    assert N.thread_limit() == 4  # a cap above the pool's size changes nothing
    N.set_thread_role(0, 0)
    for bad in ((2, 0), (-1, 0), (0, -1), (0, 1.5)):
        with pytest.raises(ValueError, match="set_thread_role"):
            N.set_thread_role(*bad)
    N.set_num_threads(before)


@pytest.mark.parametrize("acc_role, adam_role", [((1, 1), (0, 1)), ((1, 2), (0, 3)), ((0, 1), (0, 0))])
def test_two_pools_and_caps_give_the_same_bits(acc_role, adam_role):
    """The accumulation thread on pool 1 and the update on pool 0, each capped, at once: the bits
    are those of one thread alone (the reduction order depends on the run lists only)."""
    n = 700_000
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(n, generator=gen).bfloat16()
    runs = torch.tensor([[0, 300_000], [310_000, 390_000]], dtype=torch.int64)
    p0 = torch.randn(n, generator=gen)
    before = N.get_num_threads()
    N.set_num_threads(1)
    ref_p, ref_m, ref_v, ref_acc = p0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for step in range(1, 6):
        N.adamw_step(ref_p, g, ref_m, ref_v, runs=runs, **{**HP, "step": step})
        N.accumulate(ref_acc, g, scale=0.25, runs=runs)
    ref_norm = N.sq_norm(ref_acc)
    N.set_num_threads(4)
    p, m, v, acc = p0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    norms = []

    def adam_worker():
        N.set_thread_role(*adam_role)
        for step in range(1, 6):
            N.adamw_step(p, g, m, v, runs=runs, **{**HP, "step": step})

    worker = threading.Thread(target=adam_worker)
    worker.start()
    N.set_thread_role(*acc_role)
    try:
        for _ in range(5):
            N.accumulate(acc, g, scale=0.25, runs=runs)
        norms.append(N.sq_norm(acc))
    finally:
        N.set_thread_role(0, 0)
        worker.join()
        N.set_num_threads(before)
    assert torch.equal(p, ref_p) and torch.equal(m, ref_m) and torch.equal(v, ref_v)
    assert torch.equal(acc, ref_acc) and norms == [ref_norm]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pool_survives_fork():
    """A forked child (e.g. a DataLoader worker) inherits no pool threads; it must not hang."""
    N.set_num_threads(2)
    x = torch.ones(600_000)
    assert N.sq_norm(x) == 600_000.0  # the parent's pool is running now
    code = (
        "import os, signal, torch\n"
        "from zfctl import _native as N\n"
        "N.set_num_threads(2); x = torch.ones(600_000); N.sq_norm(x)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(20)\n"
        "    os._exit(0 if N.sq_norm(x) == 600_000.0 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "raise SystemExit(os.waitstatus_to_exitcode(status))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    assert done.returncode == 0


@pytest.mark.slow
def test_missing_library_is_a_user_error():
    code = (
        "import sys; sys.modules['zfctl._zfnative'] = None\n"
        "from zfctl.errors import UserError\n"
        "try:\n"
        "    import zfctl._native\n"
        "except UserError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ZFCTL_NATIVE_VARIANT"}
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, env=env)
    assert "native CPU-Adam is not built: run `make setup`" in done.stdout


def test_pinned_pools_give_the_same_bits_and_the_caller_its_cpus_back():
    """Pinning (zf_set_pool_cpus) moves threads, never results; the calling thread, moved onto
    cpus[0] for the call, ends with the CPUs it had (it may be the training thread)."""
    cpus = sorted(os.sched_getaffinity(0))
    before, mask = N.get_num_threads(), os.sched_getaffinity(0)
    n = 1_500_000
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    results = []
    try:
        N.set_num_threads(3)
        for pinned in ([], cpus[::-1], [cpus[0]]):
            N.set_pool_cpus(0, pinned)
            p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
            for step in (1, 2):
                N.adamw_step(p, g, m, v, **{**HP, "step": step})
            results.append((p, m, v))
            assert os.sched_getaffinity(0) == mask
    finally:
        N.set_pool_cpus(0, [])
        N.set_num_threads(before)
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], got))
