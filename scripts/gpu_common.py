"""What scripts/gpu_check.py and scripts/gpu_7b.py share: find the GPU, prepare an offline
machine (wheels, imports, the native build after a check of everything it needs), run a command
with a time limit, describe the machine, merge JSON results.

Standard library only: these scripts must start on a GPU machine that has the system's torch
and nothing of zfctl's other dependencies yet (they arrive as wheels in .whl/, installed here
into a target folder). Everything that needs torch runs in a child process.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
DEFAULT_SITE = Path(os.environ.get("ZFCTL_GPU_SITE", "/tmp/zfctl-site"))
# What zfctl imports at run time (pyproject.toml dependencies; `yaml` is PyYAML) plus pytest, for
# the GPU tests. The GPU image lacks some of them: scripts/fetch_gpu_wheels.sh fetches those.
RUNTIME_MODULES = ("typer", "rich", "yaml", "transformers", "tokenizers", "safetensors", "datasets",
                   "xxhash", "cffi", "pytest")

# Runs in the child: torch is imported there, never in these scripts' own process.
_PROBE = r"""
import json, sys, sysconfig
out = {"python": sys.version.split()[0], "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX")}
try:
    import torch
except Exception as e:
    out.update(gpus=0, why=f"torch is not importable with {sys.executable} ({type(e).__name__}: {e})")
else:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = None if n else "torch.cuda.is_available() is False" + ("" if torch.version.cuda else " (a CPU-only torch)")
    out.update(gpus=n, why=why, torch=torch.__version__, cuda=torch.version.cuda,
               gpu_names=[torch.cuda.get_device_name(i) for i in range(n)],
               gpu_bytes=[torch.cuda.get_device_properties(i).total_memory for i in range(n)])
print(json.dumps(out))
"""


# Imports each module named on its command line; prints {module: error} for those that fail.
_IMPORTS = r"""
import importlib, json, sys
bad = {}
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad[m] = f"{type(e).__name__}: {e}"
print(json.dumps(bad))
"""


# Runs in the child, with the interpreter that will build: what native/build.py needs (a C
# compiler, Python.h, setuptools and cffi, which cffi's compile step imports), as facts.
_BUILD_FACTS = r"""
import importlib.util, json, os, shutil, sys, sysconfig
cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
include = sysconfig.get_paths().get("include") or ""
print(json.dumps({"cc": cc, "cc_found": shutil.which(cc) is not None,
                  "python_h": os.path.join(include, "Python.h"),
                  "python_h_found": os.path.isfile(os.path.join(include, "Python.h")),
                  "python": "%d.%d" % sys.version_info[:2],
                  "setuptools": importlib.util.find_spec("setuptools") is not None,
                  "cffi": importlib.util.find_spec("cffi") is not None}))
"""


def missing_build_prerequisites(facts: dict[str, Any]) -> list[str]:
    """What the native build lacks, each with how to get it (empty: nothing), from the facts
    ``_BUILD_FACTS`` reports."""
    out = []
    if not facts.get("cc_found"):
        out.append(f"a C compiler ('{facts.get('cc', 'cc')}' not found: apt-get install build-essential, or set CC)")
    if not facts.get("python_h_found"):
        v = facts.get("python", "3")
        out.append(f"Python.h ({facts.get('python_h') or 'no include path'} missing: apt-get install python{v}-dev)")
    if not facts.get("setuptools"):
        out.append("setuptools (pip install setuptools, or bring its wheel in .whl/)")
    if not facts.get("cffi"):
        out.append("cffi (pip install cffi, or bring its wheel in .whl/)")
    return out


def check_build_prerequisites(py: str, env: dict[str, str]) -> None:
    """Raise Failed with ONE line naming every missing build prerequisite, before the build."""
    res = capture([py, "-c", _BUILD_FACTS], env=env, timeout=120, cwd=ROOT)
    try:
        facts = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise Failed(f"{py} could not check the native build's prerequisites: {_last_line(res.stderr)}") from None
    missing = missing_build_prerequisites(facts)
    if missing:
        raise Failed(f"the native CPU-Adam cannot be built with {py}, it needs: {'; '.join(missing)}")


def capture(cmd: list[str], *, timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    """`cmd` to completion with its output captured; a non-zero exit is the caller's to read."""
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, **kw)


def probe(py: str, timeout: float = 120) -> dict[str, Any]:
    """python, torch and CUDA as `py` sees them: {'gpus': N, 'why': reason when N == 0, ...}."""
    try:
        res = capture([py, "-c", _PROBE], timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"gpus": 0, "why": f"{py} did not answer the CUDA probe within {timeout:.0f} s"}
    except OSError as e:
        return {"gpus": 0, "why": f"cannot run {py}: {e.strerror}"}
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return {"gpus": 0, "why": f"the CUDA probe failed under {py}: {tail}"}


def git_commit() -> str:
    """Short commit of the checkout, '-dirty' when tracked files differ; 'unknown' without git."""
    try:
        head = capture(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, timeout=30)
        dirty = capture(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = head.stdout.strip()
    if head.returncode != 0 or not sha:
        return "unknown"
    return sha + ("-dirty" if dirty.stdout.strip() else "")


def machine(info: dict[str, Any]) -> dict[str, Any]:
    """The machine a part ran on: GPUs (nvidia-smi, else torch), torch/CUDA, CPU, RAM."""
    gpus = []
    try:
        fields = "name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current"
        q = capture(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"], timeout=30)
        for line in q.stdout.strip().splitlines() if q.returncode == 0 else []:
            name, mem, driver, gen, width = (f.strip() for f in line.split(","))
            gpus.append({"name": name, "memory_mib": _num(mem), "driver": driver, "pcie": f"gen{gen} x{width}"})
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    if not gpus:  # no nvidia-smi: what torch said
        gpus = [{"name": n, "memory_mib": b // 2**20, "driver": None, "pcie": None}
                for n, b in zip(info.get("gpu_names", []), info.get("gpu_bytes", []), strict=False)]
    return {
        "gpus": gpus,
        "torch": info.get("torch"),
        "cuda": info.get("cuda"),
        "python": info.get("python"),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "host_ram_bytes": _meminfo("MemTotal"),
        "hostname": platform.node(),
    }


def _num(s: str) -> int | None:
    try:
        return int(float(s))
    except ValueError:
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Failed(Exception):
    """A one-line reason to stop; the scripts print it and exit 1."""


def prepare(py: str, ext_suffix: str | None, site: Path = DEFAULT_SITE) -> dict[str, str]:
    """Install .whl/*.whl into `site` (once per set of wheels), check that every module zfctl
    needs imports, build the native CPU-Adam if missing or older than its sources. Returns the
    environment children run in (PYTHONPATH = site, repo root)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    wheels = sorted(WHEELS.glob("*.whl"))
    stamp = site / ".zfctl-wheels"
    names = "\n".join(w.name for w in wheels)
    if wheels and not (stamp.is_file() and stamp.read_text() == names):
        res = capture([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    "--upgrade", "--target", str(site), *map(str, wheels)], timeout=300)
        if res.returncode != 0:
            raise Failed(f"pip could not install .whl/*.whl into {site}: {_last_line(res.stderr)}")
        stamp.write_text(names)
    res = capture([py, "-c", _IMPORTS, *RUNTIME_MODULES], env=env, timeout=300, cwd=ROOT)
    try:
        bad = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise Failed(f"{py} could not check zfctl's modules: {_last_line(res.stderr)}") from None
    if bad:
        first = next(iter(bad.values()))
        raise Failed(f"{py} cannot import {', '.join(bad)} ({first}): on a networked machine run "
                     "scripts/fetch_gpu_wheels.sh, then bring .whl/ along")
    so = ROOT / "zfctl" / f"_zfnative{ext_suffix or '.so'}"
    sources = [*ROOT.glob("native/*.c"), *ROOT.glob("native/*.h"), ROOT / "native" / "build.py"]
    if not so.exists() or so.stat().st_mtime < max(p.stat().st_mtime for p in sources):
        check_build_prerequisites(py, env)  # one line naming all of them, not the first build error
        res = capture([py, "native/build.py"], env=env, timeout=300, cwd=ROOT)
        if res.returncode != 0:
            raise Failed(f"native/build.py failed: {_last_line(res.stderr or res.stdout)}")
    return env


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def run_logged(cmd: list[str], log: Path, *, timeout: float, env: dict[str, str],
               poll: Callable[[int], None] | None = None) -> tuple[int | None, float]:
    """Run `cmd` from the repo root, its output to the console and to `log`; call `poll(pid)`
    every 0.5 s while it runs. Returns (exit code, seconds); the code is None when it ran past
    `timeout` and was stopped (SIGTERM to its process group, SIGKILL 20 s later)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # A session of its own, so that stopping it reaches what it started (pytest, torchrun's launcher).
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True, errors="replace")
    tee = threading.Thread(target=_tee, args=(proc, log), daemon=True)
    tee.start()
    code: int | None = None
    while code is None:
        if poll is not None:
            poll(proc.pid)
        try:
            code = proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if time.monotonic() - t0 > timeout:
                _stop(proc)
                print(f"[stopped after {timeout:.0f} s: {' '.join(cmd[:4])} ...]", flush=True)
                break
    tee.join(timeout=5)
    return code, time.monotonic() - t0


def _tee(proc: subprocess.Popen, log: Path) -> None:
    assert proc.stdout is not None
    with open(log, "w") as f:
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
    sys.stdout.flush()


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)  # the group this call created (start_new_session)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class TreeSampler:
    """Peak memory of a process and everything it started, read from /proc each time it is
    called (as run_logged's `poll`). VmHWM is the kernel's own per-process peak, so a process's
    peak is exact as long as it is sampled once before it exits; the sum of the tree's VmRSS is
    only as good as the sampling interval."""

    def __init__(self) -> None:
        self.hwm: dict[int, int] = {}
        self.tree_rss_peak = 0

    def __call__(self, pid: int) -> None:
        total = 0
        for p in _tree(pid):
            st = _vm(p)
            if st:
                self.hwm[p] = max(self.hwm.get(p, 0), st.get("VmHWM", 0))
                total += st.get("VmRSS", 0)
        self.tree_rss_peak = max(self.tree_rss_peak, total)

    def result(self) -> dict[str, Any]:
        return {"max_process_vmhwm_bytes": max(self.hwm.values(), default=None),
                "tree_rss_peak_bytes": self.tree_rss_peak or None, "processes_seen": len(self.hwm)}


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:  # gone already
            pass
    return out


def _vm(pid: int) -> dict[str, int]:
    """VmHWM / VmRSS of `pid` in bytes ({} once it has exited: a zombie has no Vm lines)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in lines)
            if k in ("VmHWM", "VmRSS")}


def load_doc(path: Path, commit: str) -> dict[str, Any]:
    """The results an earlier part wrote to `path` (a fresh document if none). Results of
    another commit are never mixed in: that is an error naming both commits."""
    if not path.exists():
        return {"commit": commit, "parts": {}}
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise Failed(f"{path} is not a results file this script wrote ({e}): pass another --out") from None
    if doc.get("commit") != commit:
        raise Failed(f"{path} holds results of commit {doc.get('commit')}, this checkout is {commit}: "
                     "pass another --out, or remove the file to start over")
    return doc


def write_doc(path: Path, doc: dict[str, Any]) -> None:
    """Write to a temporary file beside `path`, then rename: a part stopped mid-write leaves the
    previous parts' file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
