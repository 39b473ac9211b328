"""scripts/gpu_check.py and gpu_results.py on CPU: the JSON it assembles from fake bench outputs, the acceptance
ratios, merging parts, and what it does on a machine without CUDA (nothing, quickly)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_script_helpers import REPO, SCRIPTS, bench_file, gpu_check, gpu_common, gpu_results

HOST = {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "driver": "580.159.04",
                  "pcie": "gen5 x16"}], "torch": "2.11.0+cu130", "cuda": "13.0", "cpu_model": "fake", "cpu_cores": 16}


def fake_part(folder, batch: int, *, device_ms: float = 170.0, skip: tuple[str, ...] = ()) -> None:
    """What `scripts/bench_zenflow_gpu.sh llama` leaves for one batch size (see the numbers below)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = {4: (150.0, 600.0), 1: (120.0, 550.0)}[batch]
    if "paper" not in skip:
        bench_file(folder, batch, "paper", {"off": [base[0]] * 8, "zero-offload": [base[1]] * 8, "zenflow": [190.0] * 8})
    if "default-host" not in skip:
        # b4: mean 180, median 170 (a slow step every 4); b1: 200 flat, CPU update too slow to hide;
        # the first step selects, as fast as an ordinary one
        steps = [170.0, 170.0, 170.0, 210.0] * 2 if batch == 4 else [200.0] * 8
        bench_file(folder, batch, "default-host", {"zenflow": steps}, cpu_ms=500.0 if batch == 4 else 700.0,
                   selections=(0,))
    if "default-device" not in skip:
        bench_file(folder, batch, "default-device", {"zenflow": [device_ms] * 8}, accumulate="device",
                   selections=(0,))


def bench_result(folder, batch: int) -> dict:
    return {"status": "passed", "seconds": 1.0, "section": gpu_results.collect_bench(folder)}


def by_name(entries: list[dict]) -> dict[str, dict]:
    return {e["name"]: e for e in entries}


def test_figures_from_a_bench_file(tmp_path):
    fake_part(tmp_path, 4)
    bench = gpu_results.collect_bench(tmp_path)
    assert set(bench) == {"b4"}
    assert set(bench["b4"]) == {"off", "zero-offload", "paper", "default-host", "default-device"}
    d = bench["b4"]["default-host"]
    assert d["ms_per_step"] == {"mean": pytest.approx(180.0), "median": pytest.approx(170.0)}
    assert d["stall_ms_per_step"] == pytest.approx(18.0)
    assert d["device_ms_per_step"] == pytest.approx(45.0 + 90.0 + 2.0)  # forward + backward + device opt
    assert d["gpu_busy_pct"] == pytest.approx(100 * 137.0 / 180.0)
    assert d["cpu_update_ms"] == pytest.approx(500.0)
    assert d["d2h_gbps_per_step"] == pytest.approx(0.5 / 0.180)  # 0.5 GB per 180 ms step
    assert d["d2h_link_gbps"] == 54.9
    assert (d["peak_host_rss_bytes"], d["peak_device_reserved_bytes"]) == (30 * 2**30, 10 * 2**30)
    assert d["interval"] == 4 and d["accumulate"] == "host" and d["source"] == "llama-1b-b4-default-host.json"
    assert bench["b4"]["default-device"]["accumulate"] == "device"
    assert bench["b4"]["off"]["accumulate"] == "host" and bench["b4"]["off"]["cpu_update_ms"] is None
    assert bench["b4"]["paper"]["ms_per_step"]["mean"] == pytest.approx(190.0)


def test_acceptance_ratios_and_verdicts(tmp_path):
    fake_part(tmp_path / "b1", 1)
    fake_part(tmp_path / "b4", 4)
    bench = {**gpu_results.collect_bench(tmp_path / "b1"), **gpu_results.collect_bench(tmp_path / "b4")}
    acc = by_name(gpu_results.acceptance(bench))
    a = acc["ZenFlow default / off"]
    assert (a["config"], a["baseline"], a["target"]) == ("b4/default-host", "b4/off", 0.80)
    assert a["ratio"] == pytest.approx(150 / 180) and a["ratio_median"] == pytest.approx(150 / 170)
    assert a["status"] == "pass"
    assert acc["ZenFlow default / zero-offload"]["ratio"] == pytest.approx(600 / 180)
    assert acc["ZenFlow default / zero-offload"]["status"] == "pass"
    assert acc["accumulate device / off"]["ratio"] == pytest.approx(150 / 170)  # 0.88 < 0.90
    assert acc["accumulate device / off"]["status"] == "fail"
    assert acc["ZenFlow default / off at batch 1"]["ratio"] == pytest.approx(120 / 200)  # 0.60 < 0.65
    assert acc["ZenFlow default / off at batch 1"]["status"] == "fail"


def test_ratio_exactly_at_target_passes_and_just_below_fails(tmp_path):
    fake_part(tmp_path / "ok", 4, device_ms=150 / 0.9)
    fake_part(tmp_path / "low", 4, device_ms=150 / 0.9 + 0.01)
    ok = by_name(gpu_results.acceptance(gpu_results.collect_bench(tmp_path / "ok")))["accumulate device / off"]
    low = by_name(gpu_results.acceptance(gpu_results.collect_bench(tmp_path / "low")))["accumulate device / off"]
    assert (ok["status"], low["status"]) == ("pass", "fail")


def test_a_missing_configuration_is_missing_not_a_pass(tmp_path):
    fake_part(tmp_path, 4, skip=("default-device",))
    acc = by_name(gpu_results.acceptance(gpu_results.collect_bench(tmp_path)))
    dev = acc["accumulate device / off"]
    assert dev["status"] == "missing" and dev["ratio"] is None
    assert "b4/default-device: not measured" in dev["why"] and "bench-b4" in dev["why"]
    assert acc["ZenFlow default / off"]["status"] == "pass"  # the others still compare
    b1 = acc["ZenFlow default / off at batch 1"]
    assert b1["status"] == "missing" and "b1/default-host" in b1["why"] and "b1/off" in b1["why"]


def test_another_shape_or_cpu_timing_is_never_compared(tmp_path):
    bench_file(tmp_path, 4, "paper", {"off": [150.0] * 4, "zero-offload": [600.0] * 4}, seq_len=512)
    bench_file(tmp_path, 4, "default-host", {"zenflow": [100.0] * 4}, timing="wall clock")
    acc = by_name(gpu_results.acceptance(gpu_results.collect_bench(tmp_path)))
    why = acc["ZenFlow default / off"]["why"]
    assert acc["ZenFlow default / off"]["status"] == "missing"
    assert "b4/off: measured on llama3.2-1b batch 4 x 512 bf16" in why
    assert "b4/default-host" in why and "wall clock" in why


def test_cpu_update_hidden_behind_interval_x_device_time(tmp_path):
    fake_part(tmp_path / "b1", 1)
    fake_part(tmp_path / "b4", 4)
    bench = {**gpu_results.collect_bench(tmp_path / "b1"), **gpu_results.collect_bench(tmp_path / "b4")}
    hid = {h["config"]: h for h in gpu_results.cpu_update_hidden(bench)}
    assert set(hid) == {"b1/default-host", "b1/default-device", "b4/default-host", "b4/default-device"}
    b4 = hid["b4/default-host"]
    assert b4["budget_ms"] == pytest.approx(4 * 137.0) and b4["hidden"] is True  # 500 ms <= 548 ms
    b1 = hid["b1/default-host"]
    assert b1["budget_ms"] == pytest.approx(4 * (50.0 + 100.0 + 2.0)) and b1["hidden"] is False  # 700 > 608


def bound(path: str, batch: int) -> str:
    """The name of a path's bound check (gpu_results.within_bound)."""
    return f"{path} within 1.3x of its bound at batch {batch}"


def test_each_path_is_held_to_the_bound_its_bytes_set(tmp_path):
    """measured / bound <= 1.3 per path and batch. fake_part's files hold `off` beside `paper`
    only, so the other paths' device compute is rebuilt from that `off` row: its forward + backward
    (3/4 of its 150 ms step at batch 4) + the path's own device optimizer (2 ms)."""
    fake_part(tmp_path / "b4", 4, device_ms=1.3 * 114.5)
    fake_part(tmp_path / "b1", 1)
    bench_file(tmp_path / "b1", 1, "default-host", {"zenflow": [200.0] * 8}, host_bytes=17_000_000_000)
    bench = {**gpu_results.collect_bench(tmp_path / "b1"), **gpu_results.collect_bench(tmp_path / "b4")}
    assert bench["b4"]["default-device"]["bound_device_source"] == "own"  # what the file printed
    checks = {c["config"]: c for c in gpu_results.within_bound(bench)}
    dev = checks["b4/default-device"]
    assert (dev["bound_ms"], dev["limit"], dev["device_compute"]) == (pytest.approx(114.5), "device",
                                                                        "off row of this batch")
    assert dev["ratio"] == pytest.approx(1.3) and dev["status"] == "pass"  # exactly at the target
    assert dev["printed"]["bound_ms"] == pytest.approx(0.75 * 1.3 * 114.5 + 2)  # its own passes: a laxer bound
    host = checks["b4/default-host"]
    assert host["ratio"] == pytest.approx(180 / 114.5) and host["status"] == "fail"
    # 17 GB of host memory per step at 100 GB/s: 170 ms, slower than the device's 92 ms
    b1 = checks["b1/default-host"]
    assert (b1["limit"], b1["bound_ms"], b1["status"]) == ("host", pytest.approx(170.0), "pass")
    missing = gpu_results.within_bound({"b4": bench["b4"]})
    assert [c["status"] for c in missing if c["config"].startswith("b1/")] == ["missing", "missing"]
    bench["b4"]["default-host"]["bound_ms"] = None  # a bench from before the bound
    assert "printed no bound" in {c["config"]: c for c in gpu_results.within_bound(bench)}["b4/default-host"]["why"]


def test_a_selection_step_is_held_to_twice_an_ordinary_one(tmp_path):
    """Per path and batch, the timed selection steps' mean over the median of the steps that
    neither select nor end an interval is at most 2 (gpu_results.selection_cost); a failing one
    fails the verdict, and a bench without a timed selection step leaves it missing."""
    fake_part(tmp_path, 4)
    # ordinary steps 100-110 ms (median 104), update steps (every 4th) 300 ms, which are no
    # ordinary steps (counted in, the median would be 110); selections of 200 and 216 ms: their
    # mean is exactly 2x, a pass
    steps = [200.0, 100.0, 104.0, 300.0, 110.0, 110.0, 100.0, 300.0, 216.0, 104.0, 100.0, 300.0]
    bench_file(tmp_path, 4, "default-host", {"zenflow": steps}, selections=(0, 8))
    bench_file(tmp_path, 4, "default-device", {"zenflow": [100.0] * 3 + [150.0] + [201.0] + [100.0] * 3},
               accumulate="device", selections=(4,))
    bench = gpu_results.collect_bench(tmp_path)
    checks = {c["config"]: c for c in gpu_results.selection_cost(bench)}
    host, dev = checks["b4/default-host"], checks["b4/default-device"]
    assert (host["selection_ms"], host["ordinary_ms"], host["steps"]) == (208.0, 104.0, 2)
    assert host["ratio"] == pytest.approx(2.0) and host["status"] == "pass"
    assert dev["ratio"] == pytest.approx(2.01) and dev["status"] == "fail"
    assert checks["b1/default-host"]["status"] == "missing"  # no batch-1 bench
    doc = gpu_results.merge({}, "bench-b4", bench_result(tmp_path, 4), HOST)
    assert dev["name"] in doc["verdict"]["failed"] and host["name"] not in doc["verdict"]["failed"]
    assert any("b4/default-device: selection step / ordinary step 2.01x" in line
               for line in gpu_results.summary_lines(doc))
    flat = tmp_path / "flat"  # no step selects
    flat.mkdir()
    bench_file(flat, 4, "default-host", {"zenflow": [100.0] * 8})
    none = {c["config"]: c for c in gpu_results.selection_cost(gpu_results.collect_bench(flat))}
    assert none["b4/default-host"]["status"] == "missing" and "no timed selection step" in none["b4/default-host"]["why"]


def test_parts_merge_into_one_file_and_a_rerun_replaces_its_part(tmp_path):
    out = tmp_path / "gpu-check.json"
    doc = gpu_common.load_doc(out, "abc1234")
    tests = {"status": "passed", "seconds": 80.0,
             "section": {"exit_code": 0, "passed": 12, "failed": 0, "errors": 0, "skipped": 1, "failing": []}}
    doc = gpu_results.merge(doc, "tests", tests, HOST)
    gpu_common.write_doc(out, doc)
    assert doc["verdict"]["result"] == "incomplete"
    assert {a["status"] for a in doc["acceptance"]} == {"missing"}

    fake_part(tmp_path / "b1", 1)
    doc = gpu_results.merge(gpu_common.load_doc(out, "abc1234"), "bench-b1", bench_result(tmp_path / "b1", 1), HOST)
    gpu_common.write_doc(out, doc)
    fake_part(tmp_path / "b4", 4)
    doc = gpu_results.merge(gpu_common.load_doc(out, "abc1234"), "bench-b4", bench_result(tmp_path / "b4", 4), HOST)
    gpu_common.write_doc(out, doc)

    doc = json.loads(out.read_text())
    assert doc["tests"]["passed"] == 12 and set(doc["bench"]) == {"b1", "b4"}
    assert list(doc["parts"]) == ["tests", "bench-b1", "bench-b4"]
    assert doc["parts"]["bench-b4"]["machine"]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert [a["status"] for a in doc["acceptance"]] == ["pass", "pass", "fail", "fail"]
    # fake_part's paths are all above 1.3x their bound (device compute: 3/4 of `off`'s step + 2 ms)
    assert doc["verdict"] == {"result": "fail", "failed": ["accumulate device / off", "ZenFlow default / off at batch 1",
                                                           bound("default-host", 1), bound("default-device", 1),
                                                           bound("default-host", 4), bound("default-device", 4)],
                              "missing": ["nccl", "fit-24gb"], "skipped": []}

    # bench-b4 again with a faster device-accumulation run: b4 is replaced, b1 and the tests stay.
    fake_part(tmp_path / "b4-again", 4, device_ms=140.0)
    doc = gpu_results.merge(doc, "bench-b4", bench_result(tmp_path / "b4-again", 4), HOST)
    assert by_name(doc["acceptance"])["accumulate device / off"]["status"] == "pass"
    assert doc["tests"]["passed"] == 12 and "b1" in doc["bench"]
    nccl = {"status": "skipped", "reason": "needs 2 CUDA GPUs, this machine has 1",
            "section": {"status": "skipped", "reason": "needs 2 CUDA GPUs, this machine has 1"}}
    doc = gpu_results.merge(doc, "nccl", nccl, HOST)
    assert doc["verdict"] == {"result": "fail", "failed": ["ZenFlow default / off at batch 1", bound("default-host", 1),
                                                           bound("default-device", 1), bound("default-host", 4)],
                              "missing": ["fit-24gb"], "skipped": ["nccl"]}  # named: a 'pass' must not hide it
    lines = gpu_results.summary_lines(doc)
    assert "nccl: skipped (0 s), needs 2 CUDA GPUs, this machine has 1" in lines
    assert lines[-1].endswith("; skipped: nccl")
    assert "b4/default-device: measured / bound 1.22x its bound of 114 ms (device), target <= 1.3: pass" in lines
    assert any(line.startswith("b1/default-host: CPU update 700 ms vs 4 x 152 ms") and "NOT hidden" in line
               for line in lines)


def test_a_file_of_another_commit_is_refused(tmp_path):
    out = tmp_path / "r.json"
    gpu_common.write_doc(out, {"commit": "abc1234", "parts": {}})
    with pytest.raises(gpu_common.Failed, match="holds results of commit abc1234, this checkout is def5678"):
        gpu_common.load_doc(out, "def5678")
    out.write_text("{not json")
    with pytest.raises(gpu_common.Failed, match="not a results file"):
        gpu_common.load_doc(out, "abc1234")


def test_failing_part_fails_the_verdict_and_a_timed_out_bench_keeps_what_it_measured(tmp_path):
    fake_part(tmp_path, 4, skip=("default-device",))
    doc = gpu_results.merge({"commit": "x", "parts": {}}, "bench-b4",
                          {"status": "timed out", "seconds": 540.0, "missing": ["default-device"],
                           "section": gpu_results.collect_bench(tmp_path)}, HOST)
    assert doc["verdict"]["result"] == "fail" and "bench-b4" in doc["verdict"]["failed"]
    assert by_name(doc["acceptance"])["ZenFlow default / off"]["status"] == "pass"


def test_junit_counts_and_failing_ids(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "@pytest.mark.parametrize('x', [1, 2])\n"
        "def test_param(x): assert x == 1\n"
        "def test_skip(): pytest.skip('needs CUDA')\n"
        "class TestK:\n"
        "    def test_in_class(self): assert False\n")
    junit = tmp_path / "j.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                    f"--junitxml={junit}", "test_sample.py"], cwd=tmp_path, capture_output=True, timeout=120,
                   check=False)
    got = gpu_check.parse_junit(junit)
    assert (got["passed"], got["failed"], got["errors"], got["skipped"]) == (2, 2, 0, 1)
    assert got["failing"] == ["test_sample.py::test_param[2]", "test_sample.py::TestK::test_in_class"]
    assert got["skipped_ids"] == [{"id": "test_sample.py::test_skip", "reason": "needs CUDA"}]


def test_nccl_is_skipped_below_two_gpus_without_running_anything(tmp_path):
    assert gpu_check.nccl_skip_reason(0) == "needs 2 CUDA GPUs, this machine has 0"
    assert gpu_check.nccl_skip_reason(1) == "needs 2 CUDA GPUs, this machine has 1"
    assert gpu_check.nccl_skip_reason(2) is None and gpu_check.nccl_skip_reason(8) is None
    ctx = gpu_check.Context(py="/nonexistent/python", env={}, raw=tmp_path / "raw", gpus=1, timeout=1)
    res = gpu_check.run_part(ctx, "nccl")
    assert res["status"] == "skipped" and res["section"]["reason"] == "needs 2 CUDA GPUs, this machine has 1"
    assert not (tmp_path / "raw").exists()


def _metrics(path, losses, comm=1000):
    path.write_text("".join(json.dumps({"kind": "train", "step": i + 1, "loss": v, "step_ms": 40.0,
                                        "comm_bytes": comm}) + "\n" for i, v in enumerate(losses))
                    + json.dumps({"kind": "eval", "step": len(losses), "loss": 3.0}) + "\n")
    return path


def test_nccl_summary(tmp_path):
    ok = gpu_check.nccl_summary(_metrics(tmp_path / "a.jsonl", [5.0, 4.0, 3.5]), 0, 3)
    assert ok["status"] == "passed" and (ok["loss_first"], ok["loss_last"]) == (5.0, 3.5)
    assert ok["comm_bytes_per_step"] == 1000 and ok["ms_per_step_mean"] == 40.0
    assert gpu_check.nccl_summary(_metrics(tmp_path / "b.jsonl", [5.0, 4.0]), 0, 3)["status"] == "failed"
    # metrics.jsonl stores a non-finite loss as the string "nan"
    assert gpu_check.nccl_summary(_metrics(tmp_path / "c.jsonl", [5.0, "nan", 3.0]), 0, 3)["status"] == "failed"
    assert gpu_check.nccl_summary(_metrics(tmp_path / "d.jsonl", [5.0, 4.0, 3.0], comm=0), 0, 3)["status"] == "failed"
    assert gpu_check.nccl_summary(tmp_path / "none.jsonl", None, 3)["status"] == "timed out"
    assert gpu_check.nccl_summary(tmp_path / "none.jsonl", 1, 3)["status"] == "failed"


def _quick(cmd, env=None):
    """Run from the repo root with this checkout on PYTHONPATH; generous limit, never a timing check."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="checks what happens without CUDA")
def test_without_cuda_the_check_prints_one_line_and_does_nothing(tmp_path):
    out = tmp_path / "r.json"
    for cmd in ([sys.executable, "scripts/gpu_check.py", "--out", str(out)],
                ["make", "-s", "gpu-check", f"PYTHON={sys.executable}", "PART=tests nccl", f"OUT={out}"]):
        res = _quick(cmd)
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == [res.stdout.strip()] and res.stderr == ""
        assert res.stdout.startswith("gpu-check SKIPPED: no CUDA GPU here (torch.cuda.is_available() is False")
        assert not out.exists() and not out.with_suffix("").exists()


def test_bad_parts_are_refused(tmp_path):
    res = _quick([sys.executable, "scripts/gpu_check.py", "bench-b2"])
    assert res.returncode == 2 and "part 'bench-b2': use tests, bench-b1, bench-b4, nccl, fit-24gb or all" in res.stderr


def test_a_python_without_torch_counts_as_no_cuda(tmp_path):
    info = gpu_common.probe("/nonexistent/python3")
    assert info["gpus"] == 0 and "cannot run /nonexistent/python3" in info["why"]
    fake = tmp_path / "python3"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.exit(\"No module named torch\")'\n")
    fake.chmod(0o755)
    info = gpu_common.probe(str(fake))
    assert info["gpus"] == 0 and "No module named torch" in info["why"]


def test_bench_script_checks_its_arguments_before_anything(tmp_path):
    res = _quick(["bash", "scripts/bench_zenflow_gpu.sh", "grid", str(tmp_path / "o")], env={"PY": sys.executable})
    assert res.returncode == 2 and "usage:" in res.stderr
    res = _quick(["bash", "scripts/bench_zenflow_gpu.sh", "llama", str(tmp_path / "o")],
                 env={"PY": sys.executable, "BATCHES": "1 x"})
    assert res.returncode == 2 and 'BATCHES="1 x": give positive integers' in res.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(_cuda(), reason="checks what happens without CUDA")
def test_bench_script_without_cuda_stops_with_one_line(tmp_path):
    res = _quick(["bash", "scripts/bench_zenflow_gpu.sh", "llama", str(tmp_path / "o")], env={"PY": sys.executable})
    assert res.returncode == 1
    assert res.stderr.strip() == "this script needs a CUDA GPU (torch.cuda.is_available() is False)"


# -- scripts/fetch_gpu_wheels.sh, offline: a copy of it in a folder that is no git checkout --------------

# No config file (this machine's points at local mirrors) and an index on a closed local port.
OFFLINE = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}


def _fetch(tmp_path, *args):
    (tmp_path / "scripts").mkdir(exist_ok=True)
    (tmp_path / "scripts" / "fetch_gpu_wheels.sh").write_text((SCRIPTS / "fetch_gpu_wheels.sh").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return subprocess.run(["bash", str(tmp_path / "scripts" / "fetch_gpu_wheels.sh"), *args], cwd=tmp_path,
                          env={**env, **OFFLINE, "PY": sys.executable}, capture_output=True, text=True,
                          timeout=180, check=False)


def _pinned() -> list[str]:
    text = (SCRIPTS / "fetch_gpu_wheels.sh").read_text()
    return text.split("PINNED=(", 1)[1].split('"$@"', 1)[0].split()


def test_fetch_offline_is_one_line_and_exit_1(tmp_path):
    res = _fetch(tmp_path)
    assert res.returncode == 1
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("fetch_gpu_wheels: could not download cffi==")


def test_fetch_is_idempotent_and_keeps_one_version_of_each(tmp_path):
    whl = tmp_path / ".whl"
    whl.mkdir()
    for spec in _pinned():
        name, version = spec.split("==")
        (whl / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_text("fake")
    (whl / "cffi-1.0.0-cp312-cp312-manylinux2014_x86_64.whl").write_text("an older one")
    res = _fetch(tmp_path)  # offline: works only if nothing is asked of the network
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"fetched: nothing; already in .whl/: {len(_pinned())} wheel(s)")
    assert not (whl / "cffi-1.0.0-cp312-cp312-manylinux2014_x86_64.whl").exists()
    assert len(list(whl.glob("*.whl"))) == len(_pinned())


def test_fetch_refuses_a_spec_without_version(tmp_path):
    res = _fetch(tmp_path, "pyarrow")
    assert res.returncode == 2 and "pyarrow: give NAME==VERSION" in res.stderr


def test_main_runs_the_parts_it_is_given_and_adds_to_one_file(tmp_path, monkeypatch, capsys):
    """main() with the GPU machine faked: probe, setup and the parts themselves."""
    fake_part(tmp_path / "b1", 1)
    fake_part(tmp_path / "b4", 4)
    ran = []

    def fake_run_part(ctx, part):
        ran.append((part, ctx.gpus, ctx.raw))
        if part == "tests":
            return {"status": "passed", "seconds": 70.0, "section": {"exit_code": 0, "passed": 12, "failed": 0,
                                                                     "errors": 0, "skipped": 0, "failing": []}}
        if part == "nccl":
            return gpu_check.part_nccl(ctx)  # the real one: one GPU, so it is skipped
        return bench_result(tmp_path / part.removeprefix("bench-"), int(part[-1]))

    monkeypatch.setattr(gpu_check, "probe", lambda py: {"gpus": 1, "ext_suffix": ".so", "torch": "2.11.0"})
    monkeypatch.setattr(gpu_check, "prepare", lambda py, ext: {"PYTHONPATH": "x"})
    monkeypatch.setattr(gpu_check, "machine", lambda info: HOST)
    monkeypatch.setattr(gpu_check, "git_commit", lambda: "abc1234")
    monkeypatch.setattr(gpu_check, "run_part", fake_run_part)
    out = tmp_path / "res" / "gpu.json"
    assert gpu_check.main(["tests", "bench-b4", "--out", str(out)]) == 1  # device accumulation misses 0.90
    assert [p for p, _, _ in ran] == ["tests", "bench-b4"] and ran[0][2] == tmp_path / "res" / "gpu"
    text = capsys.readouterr().out
    assert "accumulate device / off (b4/default-device vs b4/off): 0.88, target >= 0.9: fail" in text
    assert "ZenFlow default / off at batch 1 (b1/default-host vs b1/off): missing, target >= 0.65: missing" in text
    assert text.rstrip().endswith(f"results: {out}")

    assert gpu_check.main(["bench-b1", "nccl", "--out", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert list(doc["parts"]) == ["tests", "bench-b4", "bench-b1", "nccl"] and doc["commit"] == "abc1234"
    assert doc["nccl"] == {"status": "skipped", "reason": "needs 2 CUDA GPUs, this machine has 1"}
    assert [a["status"] for a in doc["acceptance"]] == ["pass", "pass", "fail", "fail"]
    assert doc["verdict"]["missing"] == ["fit-24gb"]

    monkeypatch.setattr(gpu_check, "git_commit", lambda: "def5678")
    assert gpu_check.main(["tests", "--out", str(out)]) == 1
    assert "holds results of commit abc1234, this checkout is def5678" in capsys.readouterr().err
    assert len(ran) == 4  # refused before running anything


@pytest.mark.slow
@pytest.mark.skipif(_cuda(), reason="on CPU every gpu test skips, which is what this checks")
def test_tests_part_on_cpu_counts_every_gpu_test_as_skipped(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ctx = gpu_check.Context(py=sys.executable, env=env, raw=tmp_path, gpus=1, timeout=600)
    res = gpu_check.part_tests(ctx)
    t = res["section"]
    assert res["status"] == "passed" and t["exit_code"] == 0
    assert t["passed"] == 0 and t["failed"] == 0 and t["skipped"] >= 11  # tests/gpu and the bench's CUDA test
    assert all(s["reason"] == "needs CUDA" for s in t["skipped_ids"])
    ids = [s["id"] for s in t["skipped_ids"]]
    assert "tests/cli/test_bench_cli.py::test_cuda_events_time_the_step_and_agree_with_the_wall_clock" in ids
    assert any(i.startswith("tests/gpu/test_offload_gpu.py::test_cuda_limits_reproduce_torch_adamw[") for i in ids)


def _wheel(folder, name="zzfake", version="1.0"):
    """A minimal pure-Python wheel: one module, its dist-info."""
    import zipfile

    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_prepare_installs_the_carried_wheels_once_and_names_what_is_missing(tmp_path, monkeypatch):
    wheels, site = tmp_path / "whl", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels)
    monkeypatch.setattr(gpu_common, "WHEELS", wheels)
    monkeypatch.setattr(gpu_common, "RUNTIME_MODULES", ("json", "zzfake"))
    import sysconfig

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if not (REPO / "zfctl" / f"_zfnative{suffix}").exists():
        pytest.skip("the native library is not built in this checkout (prepare would build it)")
    env = gpu_common.prepare(sys.executable, suffix, site)
    assert (site / "zzfake.py").exists()
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(site), str(REPO)]
    stamp = (site / ".zfctl-wheels").stat().st_mtime_ns
    (site / "zzfake.py").write_text("VALUE = 43\n")  # a reinstall would put 42 back
    gpu_common.prepare(sys.executable, suffix, site)
    assert (site / "zzfake.py").read_text() == "VALUE = 43\n" and (site / ".zfctl-wheels").stat().st_mtime_ns == stamp

    monkeypatch.setattr(gpu_common, "RUNTIME_MODULES", ("json", "zz_not_there"))
    with pytest.raises(gpu_common.Failed, match=r"cannot import zz_not_there \(ModuleNotFoundError.*"
                                                r"scripts/fetch_gpu_wheels.sh"):
        gpu_common.prepare(sys.executable, suffix, site)


def test_build_prerequisites_are_named_all_at_once():
    """Every missing prerequisite of the native build, each with its fix, in one
    list (prepare joins it into one line)."""
    none = {"cc": "gcc", "cc_found": False, "python_h": "/usr/include/python3.12/Python.h", "python_h_found": False,
            "python": "3.12", "setuptools": False, "cffi": False}
    missing = gpu_common.missing_build_prerequisites(none)
    assert [m.split(" (")[0] for m in missing] == ["a C compiler", "Python.h", "setuptools", "cffi"]
    assert "'gcc' not found" in missing[0] and "python3.12-dev" in missing[1]
    every = {**none, "cc_found": True, "python_h_found": True, "setuptools": True, "cffi": True}
    assert gpu_common.missing_build_prerequisites(every) == []
    assert [m.split(" (")[0] for m in gpu_common.missing_build_prerequisites({**every, "setuptools": False})] == \
        ["setuptools"]


def test_prepare_names_the_missing_build_prerequisites_in_one_line_before_building(tmp_path, monkeypatch):
    """A checkout whose native library must be built, with no C compiler: prepare stops with one
    line naming it (the facts come from the interpreter that would build), and builds nothing."""
    root = tmp_path / "repo"
    (root / "native").mkdir(parents=True)
    (root / "zfctl").mkdir()
    (root / "native" / "api.c").write_text("")
    (root / "native" / "build.py").write_text("raise SystemExit('the build ran')\n")
    monkeypatch.setattr(gpu_common, "ROOT", root)
    monkeypatch.setattr(gpu_common, "WHEELS", tmp_path / "no-wheels")
    monkeypatch.setattr(gpu_common, "RUNTIME_MODULES", ("json",))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(gpu_common.Failed) as err:
        gpu_common.prepare(sys.executable, ".so", tmp_path / "site")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"the native CPU-Adam cannot be built with {sys.executable}, it needs: ")
    assert f"a C compiler ('{tmp_path / 'no-such-cc'}' not found" in msg
    monkeypatch.delenv("CC")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    gpu_common.check_build_prerequisites(sys.executable, env)  # this checkout built it: nothing missing


def test_nccl_part_runs_the_host_hook_path_page_locked_and_the_device_path(tmp_path, monkeypatch):
    """The NCCL part names its gradient paths (on CUDA `auto` would pick the
    device path for tiny-llama every time): accumulate host with the hooks and page-locked
    memory, then accumulate device; each run's verdict, and the part's."""
    runs = []

    def fake_run(cmd, log, *, timeout, env):
        runs.append(cmd)
        out = Path(cmd[cmd.index("--output") + 1])
        out.mkdir(parents=True)
        bad = "zenflow.accumulate=device" in cmd  # this run diverges
        _metrics(out / "metrics.jsonl", [5.0 - i / 100 if not bad or i < 30 else "nan"
                                         for i in range(gpu_check.NCCL_STEPS)])
        return 0, 12.0

    monkeypatch.setattr(gpu_check, "run_logged", fake_run)
    ctx = gpu_check.Context(py="python3", env={}, raw=tmp_path / "raw", gpus=2, timeout=480)
    res = gpu_check.run_part(ctx, "nccl")
    sets = [{cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"} for cmd in runs]
    assert {"zenflow.accumulate=host", "zenflow.tuning.pin_memory=true",
            "distributed.backend=nccl"} <= sets[0]
    assert {"zenflow.accumulate=device", "distributed.backend=nccl"} <= sets[1] and len(runs) == 2
    v = res["section"]["variants"]
    assert (v["host"]["status"], v["device"]["status"]) == ("passed", "failed")
    assert res["status"] == "failed" and res["seconds"] == 24.0


def test_the_fit_part_scales_the_24gb_row_to_a_disk_sized_model() -> None:
    """The parameter count the part scales by is the plan's own (scripts/gpu_7b.yaml), and the
    emulated GPU is 24 GB x the share of the 7B's parameters that FIT_LAYERS keep."""
    from zfctl.plan.memory import model_size
    from zfctl.plan.resolve import resolve_plan

    for layers in (32, gpu_check.FIT_LAYERS):
        plan = resolve_plan("llama2-7b", "alpaca-sample", config=REPO / "scripts" / "gpu_7b.yaml",
                            overrides=[f"model.config.num_hidden_layers={layers}"])
        assert model_size(plan).params == gpu_check.llama2_7b_params(layers)
    assert gpu_check.llama2_7b_params(32) == 6_738_415_616
    assert gpu_check.scaled_gpu_memory(32) == "24GB"
    small = gpu_check.llama2_7b_params(gpu_check.FIT_LAYERS)
    assert small * 19 < 32e9  # its checkpoint (~19 B per parameter) leaves room on a 64 GiB disk
    gb = float(gpu_check.scaled_gpu_memory(gpu_check.FIT_LAYERS).removesuffix("GB"))
    assert 24 * small / 6_738_415_616 <= gb < 24 * small / 6_738_415_616 + 0.1


def test_the_fit_part_reads_what_gpu_7b_recorded(tmp_path, monkeypatch) -> None:
    """part_fit runs scripts/gpu_7b.py fit on the emulated GPU, keeps its figures beside the
    plan's, and deletes the run folder (the checkpoint) afterwards."""
    calls = []

    def fake_run(cmd, log, *, timeout, env, poll=None):
        calls.append(cmd)
        out, run = Path(cmd[cmd.index("--out") + 1]), Path(cmd[cmd.index("--run-dir") + 1])
        (run / "checkpoints").mkdir(parents=True)
        log.write_text("== gpu-7b fit\n")
        out.write_text(json.dumps({
            "plan": {"fits": True, "device_total": 4.9e9, "host_total": 24e9, "size": {"params": 1_476_448_256},
                     "activation_checkpointing": True, "topk_ratio": 0.05},
            "fit": {"fits": True, "flags": "--set zenflow.topk_ratio=0.05", "changes": []},
            "parts": {"fit": {"status": "passed", "peak_device_bytes": {"allocated": 4.5e9, "reserved": 4.8e9},
                              "peak_host_rss_bytes": {"own_vmhwm": 26e9}, "ms_per_step_zenflow": {"mean": 812.0}}},
            "summary": {"device_vs_emulated_gpu": 0.9}}))
        return 0, 300.0

    monkeypatch.setattr(gpu_check, "run_logged", fake_run)
    ctx = gpu_check.Context(py=sys.executable, env={}, raw=tmp_path, gpus=1, timeout=480)
    res = gpu_check.part_fit(ctx)
    cmd = calls[0]
    assert cmd[1:3] == ["scripts/gpu_7b.py", "fit"]
    assert cmd[cmd.index("--layers") + 1] == str(gpu_check.FIT_LAYERS)
    assert cmd[cmd.index("--emulate-gpu-memory") + 1] == gpu_check.scaled_gpu_memory(gpu_check.FIT_LAYERS)
    assert res["status"] == "passed" and not (tmp_path / "fit-24gb" / "run").exists()
    sec = res["section"]
    assert sec["plan_device_bytes"] == 4.9e9 and sec["peak_device_bytes"]["reserved"] == 4.8e9
    assert sec["fit"]["flags"] == "--set zenflow.topk_ratio=0.05" and sec["activation_checkpointing"] is True
    doc = gpu_results.merge({"commit": "abc1234", "parts": {}}, "fit-24gb", res, HOST)
    assert doc["fit_24gb"] == sec and "fit-24gb" not in doc["verdict"]["missing"]
    line = next(ln for ln in gpu_results.summary_lines(doc) if ln.startswith("fit-24gb: 6-layer"))
    assert "--fit: --set zenflow.topk_ratio=0.05" in line and "peak device 4.80 GB (plan 4.90 GB)" in line
    assert line.endswith("812 ms/step")

    # gpu_7b.py stopped before writing its file (--fit found nothing): failed, with its last line
    def no_file(cmd, log, *, timeout, env, poll=None):
        log.write_text("gpu-7b: zfctl plan failed: error: --fit: nothing makes this plan fit: ...\n")
        return 1, 20.0

    monkeypatch.setattr(gpu_check, "run_logged", no_file)
    res = gpu_check.part_fit(ctx)
    assert res["status"] == "failed" and res["reason"].startswith("gpu-7b: zfctl plan failed: error: --fit")
