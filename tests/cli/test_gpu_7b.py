"""scripts/gpu_7b.py and the process helpers it shares with the GPU check, on CPU: metrics and
memory assembly, the refusals before a run, measuring a process tree from outside, and (slow) the
whole train + resume flow on tiny-llama."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from gpu_script_helpers import REPO, gpu_common, script

gpu_7b = script("gpu_7b")
GIB = 2**30


def _metrics(path, n: int, warmup: int, *, start: int = 1):
    with path.open("a") as f:
        for step in range(start, start + n):
            f.write(json.dumps({"kind": "train", "step": step, "loss": 10.0 - step / 10, "step_ms": 900.0 + step,
                                "stall_ms": 5.0, "warmup": step <= warmup, "cpu_step_ms": 400.0 if step % 4 == 0
                                else 0.0, "host_peak_gib": 100.0 + step, "device_peak_gib": 40.0}) + "\n")
        f.write(json.dumps({"kind": "eval", "step": start + n - 1, "loss": 9.0}) + "\n")
    return path


def test_phase_metrics_split_warmup_and_zenflow_steps(tmp_path):
    m = _metrics(tmp_path / "metrics.jsonl", 10, warmup=4)
    _metrics(m, 10, warmup=0, start=11)
    with m.open("a") as f:
        f.write('{"kind": "train", "step": 21, "lo')  # the torn line a killed run leaves
    train = gpu_7b.phase_metrics(m, 1, 10)
    assert (train["first_step"], train["last_step"]) == (1, 10)
    assert train["ms_per_step_warmup"] == {"mean": 902.5, "median": 902.5, "n": 4}
    assert train["ms_per_step_zenflow"]["n"] == 6 and train["ms_per_step_zenflow"]["mean"] == 907.5  # steps 5-10
    assert train["cpu_update_ms"] == 400.0
    assert train["metrics_host_peak_bytes"] == int(110.0 * GIB) and train["metrics_device_peak_bytes"] == 40 * GIB
    resume = gpu_7b.phase_metrics(m, 11, 20)
    # the resumed part's first step pays for CUDA and allocator warm-up: left out of its ms/step
    assert resume["ms_per_step_zenflow"]["n"] == 9 and resume["ms_per_step_zenflow"]["mean"] == 916.0
    assert resume["loss_first"] == pytest.approx(8.9) and resume["last_step"] == 20
    assert gpu_7b.phase_metrics(tmp_path / "none.jsonl", 1, 10)["ms_per_step_zenflow"]["n"] == 0


def test_part_record_and_summary_against_the_plan(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("step 10 ...\n\nerror: out of memory\n")
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"vm_hwm_bytes": 120 * GIB, "caching_allocator_peak_bytes": 32 * GIB,
                                 "registered_peak_bytes": 60 * GIB, "registered_available": True,
                                 "device_allocated_peak_bytes": 40 * GIB, "device_reserved_peak_bytes": 44 * GIB}))
    tree = gpu_common.TreeSampler()
    tree.hwm, tree.tree_rss_peak = {1: 119 * GIB, 2: GIB}, 121 * GIB
    metrics = gpu_7b.phase_metrics(_metrics(tmp_path / "m.jsonl", 10, 4), 1, 10)
    rec = gpu_7b.part_record(1, 300.0, log, tree, stats, metrics)
    assert rec["status"] == "failed" and rec["last_line"] == "error: out of memory"
    assert rec["peak_host_rss_bytes"] == {"outside_vmhwm": 119 * GIB, "tree_rss_sum": 121 * GIB,
                                          "own_vmhwm": 120 * GIB, "metrics_host_peak": int(110.0 * GIB)}
    assert rec["pinned_host_bytes"]["total_upper_bound"] == 92 * GIB
    assert rec["peak_device_bytes"] == {"allocated": 40 * GIB, "reserved": 44 * GIB}
    assert "metrics_host_peak_bytes" not in rec and rec["ms_per_step_zenflow"]["n"] == 6

    # no stats file (killed): the outside poll and metrics.jsonl are what is left
    killed = gpu_7b.part_record(None, 560.0, log, tree, tmp_path / "missing.json", metrics)
    assert killed["status"] == "timed out" and killed["pinned_host_bytes"]["total_upper_bound"] is None
    assert killed["peak_device_bytes"]["allocated"] == 40 * GIB and killed["peak_device_bytes"]["reserved"] is None

    doc = {"plan": {"host_total": 160 * GIB, "device_total": 40 * GIB},
           "parts": {"train": rec, "resume": killed, "other": {"status": "skipped", "reason": "x"}}}
    s = gpu_7b.summarize(doc)
    assert s["peak_host_rss_bytes"] == 120 * GIB  # the larger of the two readings of the main process
    assert s["host_vs_plan"] == pytest.approx(0.75) and s["device_vs_plan"] == pytest.approx(1.1)
    assert s["pinned_host_bytes_upper_bound"] == 92 * GIB
    # the plan's CUDA-context line is outside torch's allocator: the reserved peak is read without it
    doc["plan"] = {"host_total": 160 * GIB, "device_total": 40.5 * GIB,
                   "items": [{"name": "CUDA context", "bytes": 0.5 * GIB}, {"name": "weights", "bytes": 40 * GIB}]}
    assert gpu_7b.summarize(doc)["device_vs_plan"] == pytest.approx(1.1)


def test_preflight_refusals(tmp_path):
    plan = {"fits": False, "reasons": ["host RAM: needs 162.0 GB, this machine has 135.0 GB"],
            "size": {"params": 6_738_415_616}}
    why = gpu_7b.preflight(plan, tmp_path / "run", 17, force=False)
    assert why.startswith("zfctl plan says this machine cannot run it: host RAM: needs 162.0 GB")
    resume = gpu_7b.preflight(plan, tmp_path / "run", 17, force=False, check_plan=False)  # resume: disk only
    assert resume is None or resume.startswith("its checkpoint needs ~")
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    small = {"fits": True, "size": {"params": free // 100}}  # 19 B per param: a fifth of the free space
    assert gpu_7b.preflight(small, tmp_path / "run" / "deeper", 17, force=False) is None
    huge = {"fits": False, "size": {"params": free // 10}}  # 1.9 x the free space
    why = gpu_7b.preflight(huge, tmp_path / "run", 17, force=True)
    assert why.startswith("its checkpoint needs ~") and f"free at {tmp_path}" in why
    assert gpu_7b.preflight(huge, tmp_path / "run", None, force=True) is None  # zfctl's own check then


def test_run_logged_measures_the_whole_process_tree(tmp_path):
    # a child that starts a grandchild holding 300 MiB for 2 s
    grandchild = "b = bytearray(300 * 2**20); import time; time.sleep(2)"
    child = f"import subprocess, sys; print('child up', flush=True); subprocess.run([sys.executable, '-c', {grandchild!r}])"
    tree = gpu_common.TreeSampler()
    code, _ = gpu_common.run_logged([sys.executable, "-c", child], tmp_path / "log", timeout=120,
                                       env=dict(os.environ), poll=tree)
    assert code == 0 and (tmp_path / "log").read_text() == "child up\n"
    got = tree.result()
    assert got["processes_seen"] >= 2
    assert got["max_process_vmhwm_bytes"] >= 300 * 2**20
    assert got["tree_rss_peak_bytes"] >= 300 * 2**20


def test_run_logged_stops_what_runs_too_long(tmp_path):
    pids: list[int] = []  # from run_logged's own poll: no marker file the child may not have written yet
    cmd = [sys.executable, "-c", "import time; time.sleep(120)"]
    code, _ = gpu_common.run_logged(cmd, tmp_path / "log", timeout=1, env=dict(os.environ), poll=pids.append)
    assert code is None  # stopped, not waited for: the test itself has no timing assertion
    pid = pids[0]
    with pytest.raises(ProcessLookupError):  # _stop waited for it: gone, and reaped
        os.kill(pid, 0)


def test_the_7b_plan_resolves_to_one_512_token_sequence_per_step_on_cuda():
    # the target machine named, so the verdict does not depend on the machine running the test
    res = subprocess.run([sys.executable, "-m", "zfctl", "plan", *gpu_7b.BASE, "--max-steps", "20", "--json",
                          "--gpu-memory", "80GB", "--host-memory", "128GB"],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=180, check=False)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    plan, memory = doc["plan"], doc["memory"]
    assert plan["model"]["source"] == "config" and plan["model"]["tokenizer"] == "embedded"
    assert (plan["data"]["packing"], plan["data"]["max_length"], plan["train"]["micro_batch_size"]) == (True, 512, 1)
    assert (plan["train"]["precision"], plan["train"]["device"]) == ("bf16", "cuda")
    assert plan["zenflow"]["topk_ratio"] == 0.1 and plan["zenflow"]["update_interval"] == 4  # ZenFlow default
    assert memory["size"]["params"] == pytest.approx(6.74e9, rel=0.01)
    assert memory["host_total"] > 0 and memory["device_total"] > 0 and memory["items"]
    # what scripts/gpu_7b.yaml's header promises: the fp32 carry on the host (zfctl/plan/layouts.py:
    # slots do not fit 128 GB), ~111 GB host, ~28 GB device
    assert (memory["accumulate"], memory["grad_layout"]) == ("host", "carry")
    assert memory["host_total"] == pytest.approx(111.0e9, rel=0.02)
    assert memory["device_total"] == pytest.approx(27.8e9, rel=0.02)


def test_the_small_disk_mode_keeps_the_7b_shapes_and_its_checkpoint_fits_64_gib():
    """--disk small: the 7B's hidden size, vocabulary and per-layer shapes with 8 layers; its
    checkpoint (19 B per param: bf16 weights + the optimizer state, as preflight counts it) and
    the plan fit a lent machine (64 GiB disk, 128 GiB host, 80 GB GPU)."""
    def plan(mode: str) -> dict:
        sets = [a for o in gpu_7b.DISK_MODES[mode][0] for a in ("--set", o)]
        res = subprocess.run([sys.executable, "-m", "zfctl", "plan", *gpu_7b.BASE, *sets, "--max-steps", "20",
                              "--json", "--gpu-memory", "80GB", "--host-memory", "128GB"],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                             timeout=180, check=False)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)["memory"]

    full, small = plan("full")["size"], plan("small")
    size = small["size"]
    assert (size["hidden"], size["vocab"], size["layers"]) == (full["hidden"], full["vocab"], 8)
    # Only whole layers were cut: 24 x (attention 4 h^2 + MLP 3 h x 11008 + two norms 2 h).
    h = size["hidden"]
    assert full["params"] - size["params"] == 24 * (4 * h * h + 3 * h * 11008 + 2 * h)
    assert size["params"] == pytest.approx(1.88e9, rel=0.01)
    assert size["params"] * (2 + 17) < 40e9 < 64 * GIB  # with room for the run folder's other files
    assert small["fits"] and small["host_total"] < 64 * GIB


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks what happens without CUDA")
def test_without_cuda_the_7b_script_prints_one_line(tmp_path):
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, "scripts/gpu_7b.py", "--out", str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=180, check=False)
    assert res.returncode == 0 and res.stdout.startswith("gpu-7b SKIPPED: no CUDA GPU here")
    assert len(res.stdout.splitlines()) == 1 and not out.exists()


@pytest.mark.slow
def test_train_then_resume_flow_on_tiny_llama(tmp_path, monkeypatch):
    """The real parts, with tiny-llama on CPU in place of the 7B (20 s on the 2-core CI box)."""
    monkeypatch.setattr(gpu_7b, "BASE", ["tiny-llama", "--data", "alpaca-sample"])
    sets = ["--set", "train.device=cpu", "--set", "train.micro_batch_size=4", "--set", "train.eval_batches=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = argparse.Namespace(checkpoint_at=2, steps=4, force_run=False, part_timeout=300)
    ctx = {"py": sys.executable, "env": env, "sets": sets, "plan": {"fits": True, "size": {"params": 5_300_000}},
           "raw": tmp_path / "raw", "run_dir": tmp_path / "run", "bytes_per_param": 17}
    ctx["raw"].mkdir()
    resume_first = gpu_7b.run_part("resume", args, ctx)
    assert resume_first["status"] == "skipped" and "run part train first" in resume_first["reason"]
    parts = {p: gpu_7b.run_part(p, args, ctx) for p in ("train", "resume")}
    for name, (first, last) in {"train": (1, 2), "resume": (3, 4)}.items():
        rec = parts[name]
        assert rec["status"] == "passed", (tmp_path / "raw" / f"{name}.log").read_text()[-2000:]
        assert (rec["first_step"], rec["last_step"]) == (first, last)
        rss = rec["peak_host_rss_bytes"]
        assert rss["own_vmhwm"] > 100 * 2**20 and rss["outside_vmhwm"] > 100 * 2**20
        assert rec["pinned_host_bytes"]["caching_allocator_peak"] is None  # CUDA was never initialised
    s = gpu_7b.summarize({"plan": {}, "parts": parts})
    assert s["peak_host_rss_bytes"] == max(max(p["peak_host_rss_bytes"]["own_vmhwm"],
                                               p["peak_host_rss_bytes"]["outside_vmhwm"]) for p in parts.values())


def test_emulated_gpu_flags_and_sizes():
    assert gpu_7b.parse_gpu_memory("24GB") == 24 * 10**9 and gpu_7b.parse_gpu_memory("24GiB") == 24 * GIB
    assert gpu_7b.parse_gpu_memory(" 5.3GB ") == 5_300_000_000
    for bad in ("24", "24TB", "0GB", "lots", "-1GB", "1e400GB"):
        with pytest.raises(ValueError):
            gpu_7b.parse_gpu_memory(bad)
    assert gpu_7b.emulation_flags(None, None) == ([], [])
    assert gpu_7b.emulation_flags(None, 6) == (["--set", "model.config.num_hidden_layers=6"], [])
    flags, cap = gpu_7b.emulation_flags("24GB", None)
    assert flags == ["--gpu-memory", "24GB", "--fit"] and cap == ["--cap-gpu-memory", str(24 * 10**9)]


def test_the_process_cap_is_the_emulated_share_of_the_card():
    memstats = __import__("gpu_script_helpers").script("zf_memstats")
    assert memstats.cap_fraction(24 * 10**9, 80 * 10**9) == 0.3
    with pytest.raises(SystemExit):
        memstats.cap_fraction(100 * 10**9, 80 * 10**9)  # a cap above the card emulates nothing
    with pytest.raises(SystemExit):
        memstats.cap_fraction(0, 80 * 10**9)


def test_bad_emulation_arguments_exit_2(tmp_path):
    for args, needle in ((["--emulate-gpu-memory", "24"], "--emulate-gpu-memory '24'"),
                         (["--layers", "0"], "--layers 0"), (["fitt"], "part 'fitt'")):
        res = subprocess.run([sys.executable, "scripts/gpu_7b.py", *args, "--out", str(tmp_path / "r.json")],
                             cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
        assert res.returncode == 2 and needle in res.stderr, res.stderr


def test_the_fit_part_runs_one_capped_finetune_with_the_fit_flags(tmp_path, monkeypatch):
    """Part fit: one finetune of --steps steps, with --gpu-memory/--fit, under zf_memstats's cap."""
    seen = []

    def fake_run(cmd, log, *, timeout, env, poll=None):
        seen.append(cmd)
        return 0, 1.0

    monkeypatch.setattr(gpu_7b, "run_logged", fake_run)
    flags, cap = gpu_7b.emulation_flags("5.3GB", 6)
    args = argparse.Namespace(checkpoint_at=10, steps=20, force_run=False, part_timeout=300)
    ctx = {"py": sys.executable, "env": {}, "sets": flags, "cap": cap, "raw": tmp_path,
           "plan": {"fits": True, "size": {"params": 1000}}, "run_dir": tmp_path / "run", "bytes_per_param": 17}
    rec = gpu_7b.run_part("fit", args, ctx)
    cmd = seen[0]
    assert cmd[1:5] == ["scripts/zf_memstats.py", str(tmp_path / "fit-stats.json"), "--cap-gpu-memory", "5300000000"]
    assert cmd[5] == "finetune" and cmd[cmd.index("--max-steps") + 1] == "20"
    assert cmd[cmd.index("--gpu-memory") + 1] == "5.3GB" and "--fit" in cmd
    assert "model.config.num_hidden_layers=6" in cmd
    assert rec["status"] == "passed"


def test_plan_memory_records_the_fit_and_takes_a_plan_that_does_not_fit():
    """The plan of the emulated run (exit 0), and one that does not fit (exit 3: the preflight's
    to refuse, not an error)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    fits = gpu_7b.plan_memory(sys.executable, env, [*gpu_7b.emulation_flags("40GB", 6)[0], "--host-memory", "128GB"],
                              20)
    assert fits["fits"] is True and fits["fit"]["applied"] is True and fits["size"]["params"] == 1_476_448_256
    assert fits["activation_checkpointing"] in (True, False) and fits["topk_ratio"] >= 0.05
    small = gpu_7b.plan_memory(sys.executable, env, ["--gpu-memory", "2GB", "--host-memory", "128GB"], 20)
    assert small["fits"] is False and small["reasons"] and small["fit"]["applied"] is False
