"""The install: the host's finished CPU update into the model params, on its own CUDA stream, with
one event per parameter so that each layer's forward waits only for its own columns.

An install (docs/design.md, "Transfer scheduling", H2D parameters) DMAs the host-owned column
ranges of the install source (the upload buffer in the model dtype, or the fp32 master of an fp32
model: HostState.install_source) through the H2D ring's device slots and scatters them into the
params. Both run off the compute stream: the ring's copy stream DMAs, and the *install stream*
(owned here) waits for each chunk's copy, scatters it, and after a parameter's last chunk puts
its device-owned columns back from the device master (the column ranges carried them stale) and
records that parameter's event. Before its first scatter the install stream waits for an event
recorded on the compute stream at install time: the compute work that last read or wrote the
params (the step's forward, backward and device AdamW) comes first.

Who waits for the install, on the compute stream (device-side waits, timed as stall):

* with hooks attached (:meth:`Installer.attach`, from ``ZenFlowOptimizer.attach_install_waits``):
  each module's forward pre-hook waits for the event after its own parameters' scatter, once per
  install; the install runs in forward order (the module order of ``model.modules()``), so the
  first layers are ready first and the forward runs while the last layers are still in flight.
  A parameter no hooked module owns is installed first and waited for at install time;
* without hooks (a library user's own loop, FSDP2, data parallel), the compute stream waits for the
  whole install at install time: the next step's first use comes after it (the behaviour before
  the install stream existed);
* :meth:`Installer.wait_all` (the optimizer calls it before its own device work reads or writes
  params or the device master: a step's device update, a selection's migration, ``flush``,
  ``state_dict``, ``close``) waits for whatever no hook has waited for yet; after a forward that
  ran every hooked module, that is nothing.

The device master the restore reads is next written by the next step's device AdamW (compute
stream), which comes after the forward's waits, or after :meth:`wait_all`. Without CUDA the
install runs synchronously on the calling thread and nobody waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zfctl.offload.device.chunks import Chunk, install_params
from zfctl.offload.device.pcie import device_wait
from zfctl.offload.ledger import NOWHERE, Ledger

Restore = Callable[[Any], None]  # called with a ParamSlot once its chunks are scattered


class Installer:
    """The install stream, the per-module events of the last install, and the forward hooks."""

    ledger: Ledger = NOWHERE  # each compute-stream wait counts as one `device.install` (ledger.py)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.attached = False
        self._owners: dict[int, list[int]] = {}  # param index -> keys of the hooked modules that own it
        self._first: dict[int, int] = {}  # param index -> forward position of the first module owning it
        self._handles: list[Any] = []
        self._events: dict[int, Any] = {}  # param index -> event after its scatter (the install being run)
        self._pending: dict[int, Any] = {}  # module key -> the event its next forward waits for
        self._done: Any = None  # the last install's end, while the compute stream is not ordered after it
        self.waits: list[tuple[Any, Any]] = []  # timed compute-stream waits not yet counted (StepStats)

    def attach(self, modules: Iterable[torch.nn.Module], params: list[torch.Tensor], installed: Iterable[int]) -> int:
        """Register a forward pre-hook on every module in ``modules`` (in forward order) that owns
        one of the params whose indices are in ``installed``; returns how many were hooked.

        The contract: each of those params is read, after an install, only inside the forward of a
        module that owns it, or after :meth:`wait_all` (a param used functionally elsewhere, a
        forward run on another stream, is not covered by the hooks)."""
        if self.attached:
            raise RuntimeError("install waits are attached already")
        ids = {id(params[i]): i for i in installed}
        for pos, module in enumerate(modules):
            own = [ids[id(p)] for p in module.parameters(recurse=False) if id(p) in ids]
            if not own:
                continue
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, _args, key=pos: self._before_forward(key)))
            for i in own:
                self._owners.setdefault(i, []).append(pos)
                self._first.setdefault(i, pos)
        self.attached = bool(self._handles)
        return len(self._handles)

    def detach(self) -> None:
        """Remove the hooks (``close()``); later installs are waited for whole."""
        for h in self._handles:
            h.remove()
        self._handles, self._owners, self._first, self.attached = [], {}, {}, False

    def order(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunks in forward order of their params' first module; params no hooked module
        owns first (the compute stream waits for them at install time). Stable: a param's chunks
        keep their column order."""
        return sorted(chunks, key=lambda ch: self._first.get(ch.slot.index, -1))

    def run(self, ring: Any, chunks: list[Chunk], source: torch.Tensor, params: list[torch.Tensor],
            restore: Restore) -> tuple[int, Any]:
        """One install (module docstring): (bytes copied host to device, the event after the last
        copy that reads a page-locked ``source``, or None: HostState.install_fence)."""
        stream = None
        if self.cuda:
            assert self.stream is not None  # CUDA: made in __init__
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))  # what last read or wrote the params
            self.stream.wait_event(ready)  # device-side: the install stream comes after it
            stream = self.stream
        self._events = {}

        def finished(slot: Any) -> None:  # on the install stream: the param's last chunk is scattered
            restore(slot)  # its device-owned columns back from the device master (they rode along stale)
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self.stream)
                self._events[slot.index] = event

        nbytes, fence = install_params(ring, self.order(chunks), source, params, stream=stream, finished=finished)
        if self.cuda:
            self._publish()
        return nbytes, fence

    def _publish(self) -> None:
        """After an install is enqueued: hand each hooked module its event, or make the compute
        stream wait for the whole install now (no hooks)."""
        done = torch.cuda.Event()
        done.record(self.stream)
        if not self.attached:
            self._wait(done)  # the next step's first use comes after the whole install
            self._done, self._pending = None, {}
            return
        # Modules an earlier install left waiting keep their event (this install may not touch
        # their params); the others take this install's, later on the same stream.
        pending: dict[int, Any] = dict(self._pending)
        loose = None
        for index, event in self._events.items():  # install order: a module keeps its last param's event
            if index not in self._owners:
                loose = event  # installed before every owned param
            for key in self._owners.get(index, ()):
                pending[key] = event
        if loose is not None:
            self._wait(loose)  # params no hooked module owns: their readers are unknown
        self._pending = pending
        self._done = done if pending else None
        self._events = {}

    def _before_forward(self, key: int) -> None:
        """A hooked module's forward pre-hook: wait (on the device) for its params' install."""
        if not self._pending:
            return  # no install since this module last waited: a dict check per forward
        event = self._pending.pop(key, None)
        if event is None:
            return
        self._wait(event)
        if not self._pending:
            self._done = None  # every installed param has been waited for by its module

    def wait_all(self) -> list[tuple[Any, Any]]:
        """Order the compute stream after the whole last install (a device-side wait; nothing
        to wait for once every hooked module's forward has run since). Returns the timed waits
        not counted yet (:meth:`take_waits`), this one included."""
        if self._done is not None:
            self._wait(self._done)
        self._done, self._pending = None, {}
        return self.take_waits()

    def close(self) -> None:
        """The hooks off, and the compute stream after the last install (``close()``)."""
        self.detach()
        self.wait_all()

    def take_waits(self) -> list[tuple[Any, Any]]:
        """The timed waits since the last call, for ``pcie.count_waits`` (read one step late)."""
        waits, self.waits = self.waits, []
        return waits

    def _wait(self, event: Any) -> None:
        self.waits.append(device_wait(self.ledger, "device.install", torch.cuda.current_stream(self.device), event))
