"""The native CPU kernels of ZenFlow's offload (C in `native/`, bound with cffi).

Everything takes CPU torch tensors, contiguous, treated as flat buffers, and works in place. The
optional `runs` is an int64 tensor of shape [n, 2] of (offset, length) pairs, sorted and
non-overlapping: only those elements are read or written, which is how the CPU skips the columns
the GPU owns. Each call is one pass over memory with the GIL released, split over a pool of
threads that sleep (not spin) between calls. A bad argument raises ValueError naming it; nothing
reaches the C code unchecked (a non-tensor raises TypeError).

Results do not depend on the thread count, and the AVX-512, AVX2 and scalar paths agree bit for
bit (see native/kernels.h); `sq_norm`'s reduction order depends only on the run list.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from zfctl.errors import UserError

_ISA_NAMES = ("scalar", "avx2", "avx512")
ALL_ISAS: tuple[str, ...] = _ISA_NAMES
"""Every code path the library knows, whether or not this CPU can run it (tests skip the rest)."""


def _load():
    """The compiled module: zfctl/_zfnative, or the ASan/UBSan build when ZFCTL_NATIVE_VARIANT=asan."""
    if os.environ.get("ZFCTL_NATIVE_VARIANT") == "asan":
        build = Path(__file__).resolve().parent.parent / "native" / "build-asan"
        found = sorted(build.glob("_zfnative_asan*.so"))
        if not found:
            raise UserError("ZFCTL_NATIVE_VARIANT=asan but the sanitizer build is missing: run `make check-native`")
        spec = importlib.util.spec_from_file_location("_zfnative_asan", found[0])
        if spec is None or spec.loader is None:
            raise UserError(f"ZFCTL_NATIVE_VARIANT=asan: {found[0]} is not a loadable module; "
                            "run `make check-native`")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.ffi, module.lib
    try:
        from zfctl import _zfnative  # type: ignore[attr-defined]  # built by native/build.py, untyped
    except ImportError as exc:
        raise UserError(
            "zfctl's native CPU-Adam is not built: run `make setup` (it needs a C compiler such as gcc) "
            f"[{exc}]"
        ) from None
    return _zfnative.ffi, _zfnative.lib


ffi, lib = _load()

_DTYPE = {torch.float32: lib.ZF_F32, torch.bfloat16: lib.ZF_BF16, torch.float16: lib.ZF_F16}
_FP32 = (torch.float32,)
_ANY = (torch.float32, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)


def _check(name: str, t: object, dtypes: tuple[torch.dtype, ...], numel: int | None = None) -> torch.Tensor:
    """Validate one buffer argument; the message names the argument and what was wrong."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: must be a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: dtype must be {allowed}, got {str(t.dtype).removeprefix('torch.')}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous() or use a flat buffer)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name}: has {t.numel()} elements, expected {numel} (as many as the first argument)")
    return t


def _disjoint(**written: torch.Tensor | None) -> None:
    """Buffers the kernel writes must not share memory with each other (results would be garbage)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in written.items()
        if t is not None and t.numel() > 0
    )
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"{a} and {b} overlap in memory: pass separate buffers")


def _ptr(t: torch.Tensor | None, ctype: str = "void *"):
    return ffi.NULL if t is None else ffi.cast(ctype, t.data_ptr())


def _runs(runs: torch.Tensor | None, numel: int):
    """(pointer, count) for a validated run list, or (NULL, -1): the whole buffer."""
    if runs is None:
        return ffi.NULL, -1
    _check("runs", runs, (torch.int64,))
    if runs.dim() != 2 or runs.shape[1] != 2:
        raise ValueError(f"runs: must have shape [n, 2] of (offset, length), got {list(runs.shape)}")
    ptr, n = _ptr(runs, "int64_t *"), runs.shape[0]
    bad = lib.zf_check_runs(ptr, n, numel)
    if bad >= 0:
        off, length = runs[bad].tolist()
        raise ValueError(
            f"runs[{bad}] = ({off}, {length}): runs must be sorted, non-overlapping (offset, length) "
            f"pairs with length >= 0 inside the buffer of {numel} elements"
        )
    return ptr, n


def _check_state(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, out: torch.Tensor | None,
                 step: int, repeat: int) -> int:
    """The checks every AdamW entry point makes of the state it writes and of its step counts;
    returns the element count."""
    n = _check("param", param, _FP32).numel()
    _check("exp_avg", exp_avg, _FP32, n)
    _check("exp_avg_sq", exp_avg_sq, _FP32, n)
    if out is not None:
        _check("out", out, _HALF, n)
    _disjoint(param=param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, out=out)
    if int(step) != step or step < 1:
        raise ValueError(f"step: must be an integer >= 1 (the 1-based bias-correction count), got {step}")
    if isinstance(repeat, bool) or int(repeat) != repeat or repeat < 1:
        raise ValueError(f"repeat: must be an integer >= 1 (the number of steps to take), got {repeat!r}")
    return n


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    adamw: bool = True,
    runs: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    repeat: int = 1,
) -> None:
    """One fused AdamW (or, with adamw=False, Adam with L2 decay) step, in place, in one pass.

    Reads param/exp_avg/exp_avg_sq (fp32) and grad (fp32, bf16 or fp16, multiplied by
    `grad_scale` on the fly: interval mean, loss-scale unscaling and clipping in one factor),
    writes param/exp_avg/exp_avg_sq and, if given, `out` (bf16/fp16: the new params rounded to
    nearest even, NaN kept) for the upload to the GPU. `step` is the 1-based step count used for
    bias correction. `out` may be the gradient buffer itself (same dtype): each element's
    gradient is read before its output is written, which saves the offload a buffer. Memory
    traffic per element: 28 B with fp32 grads, 28 B with bf16 grads and a bf16 out (torch needs
    three passes for the same: cast, step, copy, 44 B).

    ``repeat`` = n > 1 takes n steps with the same gradient, bias-correction steps ``step`` ..
    ``step + n - 1``: the bits of n calls (with ``out`` written once, at the end, so ``out`` may
    still be the gradient buffer) for the memory traffic of one. ZenFlow's deferred columns use
    it (zfctl/offload/cpu/correction.py, mode ``repeat``).
    """
    n = _check_state(param, exp_avg, exp_avg_sq, out, step, repeat)
    _check("grad", grad, _ANY, n)
    runs_ptr, nruns = _runs(runs, n)
    lib.zf_adamw_steps(
        _ptr(param, "float *"), _ptr(grad), _DTYPE[grad.dtype], _ptr(exp_avg, "float *"),
        _ptr(exp_avg_sq, "float *"), _ptr(out), _DTYPE[out.dtype] if out is not None else lib.ZF_NONE,
        n, runs_ptr, nruns, int(step), int(repeat), float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), float(grad_scale), 1 if adamw else 0,
    )


MAX_SLOTS = 64  # native/kernels.h ZF_MAX_SLOTS: the most slots one adamw_sum reads


def adamw_sum(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    slots: Sequence[torch.Tensor],
    coefs: Sequence[float],
    *,
    carry: torch.Tensor | None = None,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    adamw: bool = True,
    runs: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    repeat: int = 1,
) -> None:
    """``adamw_step`` on an interval's gradient sum, formed in the same pass from its per-step
    ``slots`` (fp32, bf16 or fp16, one dtype) with each step's coefficient ``coefs[s]``: per
    element ``a = carry[i]`` (fp32; without a carry +0), then ``a = fma(slots[s][i], coefs[s], a)``
    for each slot in order, and the AdamW step(s) on ``a * grad_scale``. That is ``accumulate``'s
    rounding once per slot (its ``overwrite`` is the fma into +0), so the result has the bits of
    accumulating the slots into an fp32 buffer and calling ``adamw_step`` on it, for one pass over
    memory: per element 24 B of state plus each slot's bytes, no accumulator written or read.
    At most ``MAX_SLOTS`` slots; a carry alone (no slots) is an fp32 gradient read as it is.
    """
    n = _check_state(param, exp_avg, exp_avg_sq, out, step, repeat)
    if len(slots) != len(coefs):
        raise ValueError(f"slots and coefs: {len(slots)} slots but {len(coefs)} coefficients")
    if len(slots) > MAX_SLOTS:
        raise ValueError(f"slots: at most {MAX_SLOTS} per call, got {len(slots)}")
    if not slots and carry is None:
        raise ValueError("slots: give at least one slot or a carry (an interval has at least one step)")
    for i, s in enumerate(slots):
        _check(f"slots[{i}]", s, _ANY, n)
    dtypes = {s.dtype for s in slots}
    if len(dtypes) > 1:
        raise ValueError(f"slots: one dtype for all, got {sorted(str(d).removeprefix('torch.') for d in dtypes)}")
    if carry is not None:
        _check("carry", carry, _FP32, n)
    for name, read in (*((f"slots[{i}]", s) for i, s in enumerate(slots)), ("carry", carry)):
        for wname, written in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("out", out)):
            if read is not None:
                _disjoint(**{name: read, wname: written})
    runs_ptr, nruns = _runs(runs, n)
    slot_ptrs = ffi.new("void *[]", [_ptr(s) for s in slots] or [ffi.NULL])
    coef_arr = ffi.new("float[]", [float(c) for c in coefs] or [0.0])
    sdt = _DTYPE[slots[0].dtype] if slots else lib.ZF_F32
    lib.zf_adamw_sum(
        _ptr(param, "float *"), _ptr(exp_avg, "float *"), _ptr(exp_avg_sq, "float *"), _ptr(out),
        _DTYPE[out.dtype] if out is not None else lib.ZF_NONE, n, runs_ptr, nruns, _ptr(carry, "float *"),
        slot_ptrs, sdt, coef_arr, len(slots), int(step), int(repeat), float(lr), float(beta1), float(beta2),
        float(eps), float(weight_decay), float(grad_scale), 1 if adamw else 0,
    )


def accumulate(acc: torch.Tensor, grad: torch.Tensor, *, scale: float = 1.0, runs: torch.Tensor | None = None,
               overwrite: bool = False) -> None:
    """acc += scale * grad, in place (acc fp32; grad fp32/bf16/fp16), with one rounding (fma).

    ``overwrite``: acc = scale * grad (as if acc were zero; its old contents are never read).
    """
    n = _check("acc", acc, _FP32).numel()
    _check("grad", grad, _ANY, n)
    runs_ptr, nruns = _runs(runs, n)
    lib.zf_accumulate(_ptr(acc, "float *"), _ptr(grad), _DTYPE[grad.dtype], float(scale), n, runs_ptr, nruns,
                      int(bool(overwrite)))


def sq_norm(x: torch.Tensor, *, runs: torch.Tensor | None = None) -> float:
    """Sum of squares (accumulated in double) of x (fp32/bf16/fp16), the same bits for any thread count."""
    n = _check("x", x, _ANY).numel()
    runs_ptr, nruns = _runs(runs, n)
    return float(lib.zf_sq_norm(_ptr(x), _DTYPE[x.dtype], n, runs_ptr, nruns))


def set_num_threads(n: int) -> None:
    """Threads used per call (default: OMP_NUM_THREADS if set, else the CPUs this process may use)."""
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"set_num_threads: n must be an integer >= 1, got {n!r}")
    lib.zf_set_num_threads(int(n))


def get_num_threads() -> int:
    """Threads used per call."""
    return int(lib.zf_get_num_threads())


def set_thread_role(pool: int, max_threads: int) -> None:
    """For the calling thread only: run its calls on native pool ``pool`` (0 default, 1 second)
    with at most ``max_threads`` threads (0: get_num_threads()). The bits do not depend on it."""
    for name, v in (("pool", pool), ("max_threads", max_threads)):
        if isinstance(v, bool) or int(v) != v or v < 0:
            raise ValueError(f"set_thread_role: {name} must be an integer >= 0, got {v!r}")
    if lib.zf_set_thread_role(int(pool), int(max_threads)) != 0:
        raise ValueError(f"set_thread_role: pool must be 0 or 1, got {pool!r}")


def thread_limit() -> int:
    """Threads the calling thread's native calls may use: min(its cap, get_num_threads())."""
    return int(lib.zf_thread_limit())


def thread_pool() -> int:
    """The native pool the calling thread's calls run on (0 or 1)."""
    return int(lib.zf_thread_pool())


def pool_joins() -> int:
    """How many times a pool thread has joined a call (diagnostics: proves the threads ran)."""
    return int(lib.zf_pool_joins())


_MAX_CPUS = 256  # ZF_MAX_THREADS in native/pool.c: the longest CPU list a pool holds
_CPU_SETSIZE = 1024  # glibc's cpu_set_t


def set_pool_cpus(pool: int, cpus: Sequence[int]) -> None:
    """Pin native pool ``pool`` (0: the CPU update's, 1: the accumulation's): its worker k runs on
    ``cpus[k % len(cpus)]`` only, and a caller takes its tiles on ``cpus[0]`` for the call and gets
    its own CPUs back after. An empty list unpins. zfctl/offload/cpu/cores.py chooses the lists."""
    cpus = list(cpus)
    if isinstance(pool, bool) or pool not in (0, 1):
        raise ValueError(f"set_pool_cpus: pool must be 0 or 1, got {pool!r}")
    if len(cpus) > _MAX_CPUS:
        raise ValueError(f"set_pool_cpus: at most {_MAX_CPUS} CPUs, got {len(cpus)}")
    for c in cpus:
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < _CPU_SETSIZE:
            raise ValueError(f"set_pool_cpus: a CPU must be an integer in [0, {_CPU_SETSIZE}), got {c!r}")
    if lib.zf_set_pool_cpus(pool, ffi.new("int[]", cpus or [0]), len(cpus)) != 0:
        raise ValueError(f"set_pool_cpus: rejected pool {pool} with CPUs {cpus}")


def pool_cpus(pool: int) -> tuple[int, ...]:
    """The CPU list pool ``pool`` is pinned to (empty: not pinned)."""
    out = ffi.new("int[]", _MAX_CPUS)
    n = lib.zf_pool_cpus(int(pool), out, _MAX_CPUS)
    if n < 0:
        raise ValueError(f"pool_cpus: pool must be 0 or 1, got {pool!r}")
    return tuple(out[i] for i in range(n))


def pool_worker_cpus(pool: int) -> tuple[int, ...]:
    """The CPU each started worker of pool ``pool`` pinned itself to, -1 where it is not pinned
    (workers apply a new list at their next call: diagnostics and tests)."""
    out = ffi.new("int[]", _MAX_CPUS)
    n = lib.zf_pool_worker_cpus(int(pool), out, _MAX_CPUS)
    if n < 0:
        raise ValueError(f"pool_worker_cpus: pool must be 0 or 1, got {pool!r}")
    return tuple(out[i] for i in range(min(n, _MAX_CPUS)))


def bind_node(t: torch.Tensor, node: int) -> int:
    """Prefer NUMA node ``node`` for ``t``'s pages (whole pages around it) and move those already
    touched (mbind(2), MPOL_PREFERRED with MPOL_MF_MOVE; page-locked pages stay where they are).
    Returns 0, or the errno that refused it (EPERM in a container without CAP_SYS_NICE, ENOSYS
    without NUMA support): placement is a speed matter, so the caller reports, never fails."""
    _check("t", t, (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool))
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < 1023:
        raise ValueError(f"bind_node: node must be an integer in [0, 1023), got {node!r}")
    nbytes = t.numel() * t.element_size()
    return 0 if nbytes == 0 else -int(lib.zf_bind_node(ffi.cast("void *", t.data_ptr()), nbytes, node))


def isa() -> str:
    """The code path in use: "avx512", "avx2" or "scalar"."""
    return _ISA_NAMES[lib.zf_isa()]


def available_isas() -> list[str]:
    """The code paths this CPU (and this build) can run, best last."""
    return [name for code, name in enumerate(_ISA_NAMES) if lib.zf_isa_supported(code)]


def isa_missing_reason(name: str) -> str | None:
    """None when this CPU and build can run path `name`, else why not (for a test's skip line)."""
    if name not in _ISA_NAMES:
        return f"unknown path {name!r}"
    if lib.zf_isa_supported(_ISA_NAMES.index(name)):
        return None
    machine = platform.machine()
    if machine not in ("x86_64", "AMD64", "i386", "i686"):
        return f"{name} is an x86 path and this CPU is {machine}"
    needs = {"avx2": "avx2, fma and f16c", "avx512": "avx512f"}[name]
    return f"this CPU lacks {needs} (see the flags in /proc/cpuinfo)"


def set_isa(name: str) -> None:
    """Force a code path (tests, benchmarks). ValueError if unknown or unsupported here."""
    if name not in _ISA_NAMES:
        raise ValueError(f"set_isa: unknown path {name!r}; choose one of {', '.join(_ISA_NAMES)}")
    if lib.zf_set_isa(_ISA_NAMES.index(name)) != 0:
        raise ValueError(f"set_isa: this CPU cannot run {name!r}; available: {', '.join(available_isas())}")
