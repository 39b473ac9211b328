"""Page-locked host buffers at their exact size, for the engine's large DMA targets and sources.

torch's ``pin_memory=True`` goes through the CUDA caching host allocator, which rounds every block
up to the next power of two: a 13.48 GB buffer pins 17.18 GB, a 26.95 GB one 34.36 GB, and the
rounding is host RAM nobody can use. The engine's large host buffers (the fp32 master the install
reads, the gradient slots each step lands in, the device path's interval sum, the selection
staging) are allocated here instead: ordinary pageable memory from torch's CPU allocator,
then page-locked in place with ``cudaHostRegister`` (docs/design.md, "Threads and buffer
ownership"). The bytes pinned are the bytes asked for, rounded up to whole 4 KiB pages.

A copy ``copy_(non_blocking=True)`` to or from a registered range is a true asynchronous DMA: it
reads or writes the host memory after the call returned, so its owner must wait for the copy's
event before touching that memory again. Whether a tensor lies in a registered range is answered
by this module's own registry (:func:`holds`, by data-pointer range), never by ``is_pinned()``:
torch asks the driver about the storage's base address, and the base of a buffer from here is
the unaligned start of the raw allocation, in the page *before* the registered range, so
``is_pinned()`` says False for memory that is page-locked. Registration costs time once (the kernel faults in and locks every page:
about 1 s per 10 GB) and commits the memory at once, which is what the plan counts anyway.

Ownership: the returned tensor owns the registration. When it is garbage collected the range is
unregistered (``weakref.finalize``) before torch frees the memory; views that outlive it keep the
memory alive as ordinary pageable memory. ``release`` unregisters early (``close()`` of the
owners). Without CUDA, or with ``pin=False``, the buffer is plain pageable memory.

``registered_bytes()`` is what this process has pinned here, for the memory checks next to
``torch.cuda.host_memory_stats()`` (which counts only the caching allocator's blocks).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

PAGE = 4096
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not just the current one
_lock = threading.Lock()
_registered: dict[int, int] = {}  # page-aligned address -> bytes registered there


def _can_pin() -> bool:
    """Whether :func:`empty` page-locks (CUDA present). A seam: the CPU tests replace it, with
    :func:`_host_register` and :func:`_host_unregister`, to register plain memory's range."""
    return torch.cuda.is_available()


def _host_register(addr: int, span: int, device: torch.device | None) -> None:
    """``cudaHostRegister`` of ``span`` bytes at the page-aligned ``addr``, with ``device`` current."""
    with torch.cuda.device(device):  # None: the current device, unchanged
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(addr, span, HOST_REGISTER_PORTABLE))


def _host_unregister(addr: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(addr))


def registered_bytes() -> int:
    """Host bytes this process has page-locked through :func:`empty` and not yet released."""
    with _lock:
        return sum(_registered.values())


def holds(t: torch.Tensor) -> bool:
    """True when every byte ``t`` spans (from its data pointer over its strides) lies in one
    range registered here: a ``non_blocking`` copy from or to it is a DMA that touches it after
    the call returned, so it needs a fence. Views of a registered buffer (the master's chunk
    ranges) count; an empty tensor and device memory do not."""
    if t.numel() == 0 or t.device.type != "cpu":
        return False
    lo = t.data_ptr()
    hi = lo + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
    with _lock:
        return any(addr <= lo and hi <= addr + span for addr, span in _registered.items())


def empty(numel: int, dtype: torch.dtype, *, pin: bool, device: torch.device | None = None,
          zero: bool = False) -> torch.Tensor:
    """A flat host tensor of ``numel`` elements; page-locked at its exact size when ``pin`` and
    CUDA is available. ``device``: the GPU whose copies use it; the registration is made with
    that device current (else with the thread's current one, which may create a context on
    GPU 0) and is portable (every context may DMA it). ``zero``: filled with zeros (else
    uninitialised)."""
    if not (pin and _can_pin()) or numel == 0:
        return torch.zeros(numel, dtype=dtype) if zero else torch.empty(numel, dtype=dtype)
    nbytes = numel * dtype.itemsize
    span = -(-nbytes // PAGE) * PAGE  # whole pages: cudaHostRegister locks pages
    raw = torch.empty(span + PAGE, dtype=torch.uint8)  # one spare page to align the start
    skip = -raw.data_ptr() % PAGE
    buf = raw[skip : skip + span]
    addr = buf.data_ptr()
    _host_register(addr, span, device if device is not None and device.type == "cuda" else None)
    with _lock:
        _registered[addr] = span
    out = buf[:nbytes].view(dtype)
    # The base tensor ``raw`` is kept alive by ``out``'s storage; unregister when ``out`` dies.
    weakref.finalize(out, _unregister, addr)
    if zero:
        out.zero_()
    return out


def release(t: torch.Tensor) -> None:
    """Unregister ``t``'s pages now (idempotent; a no-op for a tensor not pinned here)."""
    addr = t.data_ptr() - t.data_ptr() % PAGE
    _unregister(addr)


def _unregister(addr: int) -> None:
    with _lock:
        if _registered.pop(addr, None) is None:
            return
    # At interpreter exit CUDA may already be torn down; the process's memory goes with it.
    with contextlib.suppress(Exception):
        _host_unregister(addr)
