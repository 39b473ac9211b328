"""`train.precision: auto`: bf16 where the hardware computes it natively, fp32 elsewhere.

bf16 halves weight and gradient memory and doubles matmul throughput on hardware built for it:
CUDA GPUs from Ampere on, x86 CPUs with AVX512-BF16 or AMX-BF16, aarch64 CPUs with the BF16
extension (Graviton3+, Grace). Everywhere else torch emulates bf16 matmuls through fp32
conversions, and that is far slower than plain fp32: fine-tuning a 5.3M-parameter tiny-llama on
an AVX2-only AMD EPYC ran at 66-103 tokens/s in bf16 against about 1.5k tokens/s in fp32
(docs/design.md, section "Defaults and the numbers behind them"). So `auto` picks bf16 only on
native hardware. A GPU without bf16 gets fp32 too: fp16 would need loss scaling, a choice the
user should make knowingly (`train.precision: fp16`).

The choice is made once, when the plan is resolved, and the concrete value is what plan.yaml and
every checkpoint store: a resumed run keeps its dtype on any machine. The detection functions take
their inputs as arguments so that tests can feed them any CPU's flags.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Literal, cast

from zfctl.gpu_probe import no_cuda_reason

# /proc/cpuinfo flag names (x86 "flags", aarch64 "Features") that mean native bf16 arithmetic.
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_BF16_FLAGS = ("bf16",)
_ARM = ("aarch64", "arm64")


@dataclass(frozen=True)
class CpuInfo:
    """What precision detection needs to know about a CPU."""

    model: str
    machine: str  # platform.machine(): x86_64, aarch64, ...
    flags: frozenset[str] | None  # None: unknown (no /proc/cpuinfo)


Precision = Literal["bf16", "fp16", "fp32"]  # what `auto` resolves to (or a concrete choice)


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision `auto` resolved to, and the one-line reason shown by `zfctl plan`."""

    precision: Precision
    reason: str


def read_cpu_info(path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CPU model and feature flags (flags None when the file cannot be read)."""
    machine = platform.machine()
    model, flags = platform.processor() or machine, None
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("flags", "features") and flags is None:  # x86: flags; aarch64: Features
                    flags = frozenset(value.split())
                elif key in ("model name", "cpu model") and model in (machine, ""):
                    model = value.strip()
    except OSError:
        pass
    return CpuInfo(model=model, machine=machine, flags=flags)


def cpu_native_bf16(cpu: CpuInfo) -> tuple[bool, str]:
    """(does this CPU compute bf16 natively, the evidence in words)."""
    if cpu.flags is None:
        return False, f"{cpu.model}: CPU flags unknown, assuming no native bf16"
    wanted = ARM_BF16_FLAGS if cpu.machine.lower() in _ARM else X86_BF16_FLAGS
    found = [f for f in wanted if f in cpu.flags]
    if found:
        return True, f"{cpu.model} has native bf16 ({', '.join(found)})"
    return False, f"{cpu.model} has no native bf16 (no {' or '.join(wanted)} flag)"


def resolve_precision(requested: str, *, device: str, cuda_bf16: bool | None = None,
                      cuda_name: str = "", cpu: CpuInfo | None = None) -> PrecisionChoice:
    """The concrete precision for `requested` on `device` ("cuda" or "cpu").

    Anything but "auto" is returned as given. For "auto": on CUDA, bf16 when `cuda_bf16` (the
    GPU supports it), else fp32; on the CPU, bf16 when `cpu` has native bf16, else fp32.
    """
    if requested != "auto":
        return PrecisionChoice(cast(Precision, requested), f"train.precision={requested} as configured")
    if device == "cuda":
        gpu = cuda_name or "the CUDA device"
        if cuda_bf16:
            return PrecisionChoice("bf16", f"train.precision auto -> bf16: {gpu} supports bf16")
        return PrecisionChoice("fp32", f"train.precision auto -> fp32: {gpu} has no bf16 support "
                                       "(set train.precision=fp16 to use half precision with loss scaling)")
    native, evidence = cpu_native_bf16(cpu if cpu is not None else read_cpu_info())
    if native:
        return PrecisionChoice("bf16", f"train.precision auto -> bf16 on the CPU: {evidence}")
    return PrecisionChoice("fp32", f"train.precision auto -> fp32 on the CPU: {evidence}; emulated bf16 "
                                   "matmuls are several times slower than fp32 there")


def resolve_for_this_machine(requested: str, train_device: str) -> PrecisionChoice:
    """`resolve_precision` with this machine's facts; `train_device` as in train.device (auto/cuda/cpu)."""
    if requested != "auto" or train_device == "cpu":
        return resolve_precision(requested, device="cpu")
    if train_device == "auto" and no_cuda_reason() is not None:  # no GPU driver: no torch needed
        return resolve_precision("auto", device="cpu")
    import torch  # only now: resolving a plan for the CPU needs no torch

    cuda = train_device == "cuda" or (train_device == "auto" and torch.cuda.is_available())
    if cuda and torch.cuda.is_available():
        return resolve_precision("auto", device="cuda", cuda_bf16=torch.cuda.is_bf16_supported(),
                                 cuda_name=torch.cuda.get_device_name(0))
    if cuda:  # train.device=cuda planned on a machine without one (the run itself would refuse)
        return resolve_precision("auto", device="cuda", cuda_bf16=True,
                                 cuda_name="the CUDA device (none visible here, assumed Ampere or newer)")
    return resolve_precision("auto", device="cpu")
