"""Shared pytest setup: the test folders on sys.path, the tests' own cache folder, GPU tests skip
without CUDA, the `isa` fixture."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The tests' own cache folder, never the user's ~/.cache/zfctl (zfctl/train/data/cache.py reads
# ZFCTL_CACHE_DIR) nor datasets' ~/.cache/huggingface/datasets (what Dataset.from_parquet writes):
# a test run must not fill, or read stale entries from, the caches a user's real runs keep. Set
# here, at import, so the processes the tests start inherit it and datasets reads it before its
# first import. One folder per session, so the shipped samples are tokenised once, not per test.
TEST_CACHE = Path(tempfile.mkdtemp(prefix="zfctl-test-cache-"))
os.environ["ZFCTL_CACHE_DIR"] = str(TEST_CACHE / "zfctl")
os.environ["HF_DATASETS_CACHE"] = str(TEST_CACHE / "hf-datasets")
atexit.register(shutil.rmtree, TEST_CACHE, ignore_errors=True)

# pytest-xdist's workers (`make test` runs the suite through it) start with COLUMNS=80 and
# LINES=24 in their environment, where a plain pytest process has neither: every rich Console made
# at import would then be pinned to 80 columns and wrap the tables the tests read. Dropped before
# any test module imports zfctl, so both runners see the same widths.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

# Tests live by layer: offload/ (the engine), native/ (the C kernels), plan/, train/, cli/ (verbs,
# benchmark and GPU scripts), e2e/ (whole runs: subprocesses, several processes), gpu/ (CUDA only).
# Slow tests (whole training runs, subprocesses that import torch, multi-rank runs: 20-90 s each on
# the loaded 2-core CI box) carry @pytest.mark.slow in their own files; `make test-fast` leaves them
# out, `make test` runs everything. Some tests import helpers from other tests' modules
# (test_offload_helpers, test_plan_memory, ...): every test folder is on sys.path.
TESTS = Path(__file__).resolve().parent
for folder in [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))]:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


# Modules whose tests start several training processes at once (ranks of one job, 2-4 processes
# that each import torch): each such run already keeps both cores of the 2-core CI box busy. Under
# the parallel runner (`make test`: pytest-xdist with `--dist loadgroup`) they form one work unit,
# run one after another on one worker, while the other workers take the one-process modules, each
# module whole (its module-scoped runs are made once, not once per worker). A module, not a test:
# a new multi-rank test in a listed module is grouped without anyone remembering to mark it.
RANK_MODULES = frozenset({
    "test_checkpoint_shards", "test_checkpoint_trust", "test_clip_rule", "test_distributed",
    "test_distributed_cli", "test_failures", "test_fsdp", "test_fsdp_bf16", "test_fsdp_cli",
    "test_fsdp_stream", "test_grad_layout_dist", "test_hsdp", "test_multinode", "test_offload_collective_order",
    "test_offload_stream_dist", "test_resume", "test_resume_faults", "test_resume_jobs",
    "test_resume_matrix", "test_run_safety", "test_stop_faults",
})


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: "ranks" for the multi-rank modules, else its module."""
    module = nodeid.split("::", 1)[0]
    return "ranks" if Path(module).stem in RANK_MODULES else module


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: plain pytest (or -p no:xdist) never calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadgroup` with the work units of :func:`work_unit`. xdist's own loadgroup finds
    `xdist_group` marks by rewriting the test's private `_nodeid`, which pytest 9.2 no longer
    reads: its groups were silently ignored (every test scheduled alone, each module's shared runs
    made on both workers). Any other `--dist` keeps xdist's scheduler."""
    if config.getoption("dist", "no") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RankUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return RankUnits(config, log)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


# Spelled out rather than read from zfctl._native, so that a missing native build fails only the
# tests that need it, not the collection of the whole suite.
ISAS = ("scalar", "avx2", "avx512")


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    """Run a kernel test once per native code path: the paths this CPU has run, the others skip
    with the reason (an AVX2-only EPYC skips avx512; an aarch64 host runs scalar only). The
    default path is restored afterwards."""
    from zfctl import _native as N

    assert N.ALL_ISAS == ISAS, "tests/conftest.py ISAS is out of date with zfctl/_native.py"
    reason = N.isa_missing_reason(request.param)
    if reason:
        pytest.skip(f"{request.param} path: {reason}")
    before = N.isa()
    N.set_isa(request.param)
    yield request.param
    N.set_isa(before)


def widen_consoles(monkeypatch: pytest.MonkeyPatch, width: int = 200, *, err_only: bool = False) -> None:
    """Widen zfctl's shared rich consoles for one test, so whole phrases stay on one line.

    Through ``_width``, what rich's ``width`` property sets: undoing it restores None (sized from
    COLUMNS again). Patching ``width`` itself would be undone by setting the width it read (80),
    pinning it for every later test in the process."""
    from zfctl.cli import _common

    monkeypatch.setattr(_common.err_console, "_width", width)
    if not err_only:
        monkeypatch.setattr(_common.console, "_width", width)


@pytest.fixture
def one_torch_thread():
    """One intra-op torch thread for the test (restored after): on the shared 2-core box two
    threads run tiny-llama's backward several times slower. Modules take it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ a shared finished run
# A finished 2-step tiny-llama run that several modules only read (tests/cli/test_train_cli.py,
# tests/e2e/test_run_safety.py): trained once per session (once per pytest-xdist worker), in
# this process, where a subprocess would spend most of its time importing torch. Each test that
# writes into it works on a copy (shutil.copytree).
FINISHED_RUN_SETS = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
    "data.end_idx=96", "data.max_length=64", "train.micro_batch_size=4", "train.eval_batches=2",
    "train.device=cpu", "train.precision=fp32", "train.eval_every=0", "logging.every=1",
    "zenflow.topk_ratio=0.1", "zenflow.update_interval=2", "zenflow.cpu_threads=1",
    "train.max_steps=2", "checkpoint.every=1",
]


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder that ended at step 2 (global batch 4, micro-batch 4, checkpoints of steps 1
    and 2). Read only."""
    from zfctl.plan.resolve import resolve_plan
    from zfctl.train import run

    out = tmp_path_factory.mktemp("finished") / "run"
    run(resolve_plan("tiny-llama", "alpaca-sample", overrides=[*FINISHED_RUN_SETS, f"checkpoint.output_dir={out}"]))
    return out


# ------------------------------------------------------------------------------ end of the shared finished run


# ------------------------------------------------------------------------------ shared reference runs
# Whole-CLI runs that several tests/e2e modules read (test_distributed_cli, test_multinode,
# test_hsdp, test_fsdp_cli), made once per session (once per pytest-xdist worker): a multi-process
# case costs its processes' start-up (Python, torch, transformers), not its 6 tiny steps, so the
# uninterrupted runs are trained once and the tests that resume copy them (shutil.copytree) before
# writing. The settings are test_distributed_cli.py's TINY: 6 steps, global batch 4, a checkpoint
# at step 3 one step into an update interval with its CPU update in flight. Here, not in a
# tests/e2e/conftest.py: a second module named conftest would shadow this one for every
# `from conftest import ...` in the suite.


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY on one process with micro-batch 4: what 2 processes (micro-batch 2), 2 nodes of 2 and
    HSDP over 2 x 2 (micro-batch 1) must lose. Read only."""
    from test_distributed_cli import finetune

    out = tmp_path_factory.mktemp("one-process") / "run"
    finetune(out, 4, 1)
    return out


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """TINY on 2 processes (``--nproc 2``, micro-batch 2, zero2): (the run folder, the launcher's
    output). Read only."""
    from test_distributed_cli import finetune

    out = tmp_path_factory.mktemp("two-processes") / "run"
    return out, finetune(out, 2, 2)


# ------------------------------------------------------------------------------ end of shared reference runs
