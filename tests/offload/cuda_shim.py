"""A stand-in for the CUDA stream and event calls, so that the CUDA branches of the transfer code
(ring.py, device_acc.py) run on CPU memory in CI and a test can see who waited for what.

``fake_cuda(monkeypatch)`` replaces ``torch.cuda.Stream``, ``Event``, ``current_stream``,
``stream`` (the context), ``_sleep`` and ``Tensor.record_stream`` with recorders, and pinned.py's
registration seam with a registry-only one, so ``pinned.empty(pin=True)`` registers a CPU
buffer's range. Copies still run, synchronously, on CPU memory; what the shim adds is the log:
every wait a stream made (``FakeStream.waits``), every event recorded and every host
``synchronize`` (``Shim.host_syncs``). It models no asynchrony: it shows which wait is written,
not that a missing one would race (tests/gpu shows that on a GPU).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from zfctl.offload.device import pinned

_ids = itertools.count()


class FakeEvent:
    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.id = next(_ids)
        self.stream: FakeStream | None = None
        self.timing = enable_timing

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream if stream is not None else SHIM.current
        self.after = list(self.stream.log)  # what the stream had done when this was recorded
        self.stream.log.append(("record", self))

    def synchronize(self) -> None:
        SHIM.host_syncs.append(self)

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: FakeEvent) -> float:
        return 0.0

    def __repr__(self) -> str:
        return f"Event#{self.id}"


class FakeStream:
    def __init__(self, device: Any = None, name: str = "copy", **_: Any) -> None:
        self.name = f"{name}#{next(_ids)}"
        self.log: list[tuple[str, Any]] = []  # ("wait_stream" | "wait_event" | "record" | "copy", what)

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", other))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", event))

    def synchronize(self) -> None:
        SHIM.host_syncs.append(self)

    @property
    def waits(self) -> list[tuple[str, Any]]:
        return [e for e in self.log if e[0] in ("wait_stream", "wait_event")]

    def __repr__(self) -> str:
        return self.name


@dataclass
class Shim:
    compute: FakeStream = field(default_factory=lambda: FakeStream(name="compute"))
    current: FakeStream = field(default_factory=lambda: FakeStream(name="unused"))
    host_syncs: list[Any] = field(default_factory=list)
    registered: list[int] = field(default_factory=list)
    # Every Tensor.copy_: (stream, dst, src, non_blocking, calling thread's name); a DMA is a
    # non_blocking copy on a copy stream, a blocking one is what a host thread would wait for.
    copies: list[tuple[Any, torch.Tensor, torch.Tensor, bool, str]] = field(default_factory=list)


SHIM = Shim()


@contextlib.contextmanager
def _on(stream: FakeStream | None):
    before = SHIM.current
    SHIM.current = stream if stream is not None else SHIM.compute
    try:
        yield
    finally:
        SHIM.current = before


def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Shim:
    """Install the shim (undone by ``monkeypatch``); returns the log."""
    global SHIM
    SHIM = Shim()
    SHIM.current = SHIM.compute
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SHIM.compute)
    monkeypatch.setattr(torch.cuda, "stream", _on)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    real_copy = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        SHIM.current.log.append(("copy", (self.data_ptr(), src.data_ptr())))
        SHIM.copies.append((SHIM.current, self, src, non_blocking, threading.current_thread().name))
        return real_copy(self, src)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(pinned, "_can_pin", lambda: True)
    monkeypatch.setattr(pinned, "_host_register", lambda addr, span, device: SHIM.registered.append(addr))
    monkeypatch.setattr(pinned, "_host_unregister", lambda addr: None)
    return SHIM


def as_cuda(obj: Any, *streams: str) -> Any:
    """Switch an object built on CPU (a Ring, a DeviceAccumulator) to its CUDA branch, with fake
    streams in the attributes ``streams`` (its memory stays on CPU)."""
    obj.cuda = True
    for name in streams:
        setattr(obj, name, FakeStream(name=name))
    return obj


def engine_on_shim(opt: Any) -> Shim:
    """Run a whole ``ZenFlowOptimizer`` built on CPU through the shim: install it, switch every
    transfer part (both rings, the hook path's stream, the device path's sum, the installer, a
    selection's migration) to its CUDA branch, and page-lock (register) the install's source (the upload buffer, else the fp32
    master) as a CUDA run with ``pin_memory`` does, so the install leaves its fence. The waits those branches write are then counted in ``StepStats.waits``
    (zfctl/offload/ledger.py) as on a GPU; the bytes are the same as without the shim. Call it
    after ``fake_cuda(monkeypatch)`` and before the first step."""
    assert SHIM.compute is SHIM.current, "call fake_cuda(monkeypatch) first"
    if opt.transfers is not None:
        as_cuda(opt.transfers.d2h, "stream")
        as_cuda(opt.transfers.h2d, "stream")
    path = opt.gradient_path
    if getattr(path, "stream", None) is not None:
        as_cuda(path.stream, "copy_stream")
    if getattr(path, "sum", None) is not None:
        as_cuda(path.sum, "copy_stream")
    as_cuda(opt.installer, "stream")  # the install stream and its per-module events (install.py)
    if opt.host is not None:  # the install's source: the upload buffer (bf16/fp16) or the master
        name = "upload" if opt.host.upload is not None else "master"
        src = getattr(opt.host, name)
        locked = pinned.empty(src.numel(), src.dtype, pin=True)
        locked.copy_(src)
        setattr(opt.host, name, locked)
    if opt.selector.selectable:  # the migration (migration.py Mover), made at the first selection
        make = opt.selector._mover

        def shimmed(pairs: int) -> Any:
            fresh = opt.selector.mover is None
            mover = make(pairs)
            if fresh:
                as_cuda(mover, "in_stream", "out_stream")
                mover.pin = True  # its ring, out buffer and ids page-locked, as with pin_memory on CUDA
            return mover

        opt.selector._mover = shimmed
    return SHIM
