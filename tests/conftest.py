"""Shared pytest setup: GPU tests skip without CUDA, the edit-loop slow list, the `isa` fixture."""

from __future__ import annotations

import pytest

# Left out of `make test-fast` (pytest -m "not slow") besides the tests marked slow in their own
# files: each of these took 20-90 s on the loaded 2-core CI box (whole training runs, 50-step
# equivalence runs, subprocesses that import torch, two-rank runs). Kept in one list so that the
# edit loop's budget is visible in one place; `make test` runs everything.
EDIT_LOOP_SLOW = {
    "tests/test_offload_equivalence.py::test_limits_reproduce_torch_adamw",
    "tests/test_offload_equivalence.py::test_lr_scheduler_drives_both_paths",
    "tests/test_offload_equivalence.py::test_warm_up_steps_are_full_offload_steps",
    "tests/test_offload_pattern.py::test_bit_identical_across_runs_slot_sizes_and_worker_timing",
    "tests/test_distributed.py::test_two_ranks_match_one_rank",
    "tests/test_native_api.py::test_pool_survives_fork",
    "tests/test_native_api.py::test_missing_library_is_a_user_error",
    "tests/test_train_presets.py::test_every_preset_trains",
    "tests/test_cli.py::test_python_m_zfctl_exit_code_and_single_stderr_line",
    "tests/test_export.py::test_exported_logits_equal_trained_model",
    "tests/test_resume.py::test_k_steps_then_resume_max_steps_matches_straight",
    "tests/test_resume.py::test_changed_plan_is_refused_then_allowed",
    "tests/test_offload_stream_dist.py::test_two_ranks_hook_path_equals_step_path",
    "tests/test_offload_stream.py::test_auto_interval_and_stream_grads_off",
    "tests/test_distributed.py::test_host_state_is_partitioned",
    "tests/test_train_presets.py::test_off_and_zero_offload_agree",
    "tests/test_checkpoint_trust.py::test_nan_step_stops_the_run_and_keep_last_keeps_the_good_checkpoints",
    "tests/test_sinks.py::test_wandb_offline_run_folder_holds_the_metrics",
    "tests/test_sinks.py::test_tensorboard_events_hold_the_metrics",
    "tests/test_sinks.py::test_missing_sink_package_is_one_line_with_the_install_command",
    "tests/test_distributed.py::test_two_rank_resume_is_exact",
    "tests/test_distributed.py::test_two_rank_state_continues_on_one_rank",
    "tests/test_distributed.py::test_one_rank_state_continues_on_two_ranks",
    "tests/test_distributed.py::test_uncovered_columns_and_old_format_from_another_rank_are_refused",
    "tests/test_failures.py::test_a_rank_raising_mid_step_ends_every_rank_with_its_one_line_error",
    "tests/test_failures.py::test_a_sigkilled_rank_ends_the_job_within_seconds_and_leaves_whole_checkpoints",
    "tests/test_failures.py::test_a_sigkilled_launcher_leaves_no_process_of_its_job",
    "tests/test_failures.py::test_a_hung_rank_ends_the_job_under_distributed_timeout_with_one_line_naming_it",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("[", 1)[0] in EDIT_LOOP_SLOW:
            item.add_marker(pytest.mark.slow)
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
