"""The optimizer's complete state, for an exact resume (mid-interval, overlap on or off).

What is saved, beyond torch.optim's param_groups (lr & co., scheduler-visible):

* counters: steps taken, steps in the unfinished interval, the last interval's length, which
  accumulator is current, whether a finished CPU update still waits to be installed;
* the selection (sorted column ids per matrix) and whether the first selection happened;
* device state: fp32 master, moments and per-column step counters (flat, as laid out);
* host state: fp32 master, moments and per-column counters (column-major), the accumulator of
  the unfinished interval, and, when an update is pending, the bf16/fp16 values it will install;
* the auto-interval statistics and the fp16 loss scaler.

An update in flight is waited for first (a stall, at checkpoint time only); its result is then
"pending": the saved model params do not contain it yet, and the next boundary after loading
installs it exactly as the uninterrupted run would. Tensors are returned as CPU copies, so the
dict stays valid while training continues. The layout depends on the parameter list and on
``topk_ratio``: loading into an optimizer that differs in either raises ValueError.

Data parallel: each rank's dict holds the replicated part (counters, selection, device state:
identical on every rank) and its own slice of the host state; ``partition`` records the world
size, the rank and the column cuts. Loading a slice into a different world size or rank raises
ValueError: the slices would have to be re-cut (concatenate the ranks' host buffers in rank order
and split them again), which is not implemented.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zfctl.offload.optimizer import ZenFlowOptimizer

STATE_FORMAT = "zfctl.zenflow/1"


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _partition(opt: ZenFlowOptimizer | None) -> dict[str, Any]:
    """Which slice of the host state a dict holds (one process: all of it)."""
    part = opt._part if opt is not None else None
    if part is None:
        return {"world_size": 1, "rank": 0}
    return {"world_size": part.world_size, "rank": part.rank, "bounds": list(part.bounds)}


def optimizer_state(opt: ZenFlowOptimizer) -> dict[str, Any]:
    """See the module docstring."""
    if opt._worker is not None and opt._worker.busy:
        opt._worker.wait()
        opt._pending_install = True
    dev = opt._device
    host = opt.host
    sd: dict[str, Any] = {
        "format": STATE_FORMAT,
        "names": list(opt.names),
        "shapes": [list(p.shape) for p in opt._params],
        "config": dataclasses.asdict(opt.config),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "counters": {
            "t": opt._t, "interval_len": opt._interval_len, "last_interval": opt._last_interval,
            "cur": opt._cur, "pending_install": opt._pending_install, "selected": opt._selected,
        },
        "selection": {opt.names[s.index]: _copy(dev.index[s.index]) for s in opt._selectable
                      if dev.index[s.index] is not None},
        "device": {k: _copy(getattr(dev, k)) for k in ("master", "exp_avg", "exp_avg_sq", "steps")},
        "host": None,
        "policy": opt._policy.state_dict(),
        "scaler": opt._scaler.state_dict() if opt._scaler is not None else None,
        "partition": _partition(opt),
    }
    if host is not None:
        sd["host"] = {k: _copy(getattr(host, k)) for k in ("master", "exp_avg", "exp_avg_sq", "steps")}
        sd["host"]["acc"] = _copy(host.acc[opt._cur])
        if opt._pending_install and host.upload is not None:
            sd["host"]["upload"] = _copy(host.upload)
    return sd


def load_optimizer_state(opt: ZenFlowOptimizer, sd: dict[str, Any]) -> None:
    """Restore ``sd`` into ``opt`` (same parameters, same topk_ratio)."""
    if sd.get("format") != STATE_FORMAT:
        raise ValueError(f"not a ZenFlow optimizer state (format {sd.get('format')!r}, expected {STATE_FORMAT!r})")
    shapes = [list(p.shape) for p in opt._params]
    for i, (name, shape) in enumerate(zip(opt.names, shapes)):
        if i >= len(sd["names"]) or sd["names"][i] != name or sd["shapes"][i] != shape:
            raise ValueError(f"optimizer state does not match parameter {i} ({name!r}, shape {shape})")
    if len(sd["names"]) != len(opt.names):
        raise ValueError(f"optimizer state has {len(sd['names'])} parameters, this optimizer {len(opt.names)}")
    if sd["config"]["topk_ratio"] != opt.config.topk_ratio:
        raise ValueError(f"optimizer state was saved with zenflow.topk_ratio={sd['config']['topk_ratio']}, "
                         f"this optimizer has {opt.config.topk_ratio}; the state layout depends on it")
    saved, mine = sd.get("partition") or _partition(None), _partition(opt)
    if saved != mine:
        raise ValueError(
            f"optimizer state is rank {saved['rank']}'s slice of host state partitioned over "
            f"{saved['world_size']} rank(s), this is rank {mine['rank']} of {mine['world_size']}: "
            f"resume with {saved['world_size']} process(es) (resharding is not supported)")
    if opt._worker is not None and opt._worker.busy:
        opt._worker.wait()  # discard: everything below is overwritten

    for group, saved in zip(opt.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    c = sd["counters"]
    opt._t, opt._interval_len, opt._last_interval = c["t"], c["interval_len"], c["last_interval"]
    opt._pending_install, opt._selected = c["pending_install"], c["selected"]

    dev = opt._device
    for k in ("master", "exp_avg", "exp_avg_sq", "steps"):
        getattr(dev, k).copy_(sd["device"][k])
    for s in opt._selectable:
        saved = sd["selection"].get(opt.names[s.index])
        dev.index[s.index] = saved.to(opt.device) if saved is not None else None

    host = opt.host
    if host is not None:
        h = sd["host"]
        for k in ("master", "exp_avg", "exp_avg_sq", "steps"):
            getattr(host, k).copy_(h[k])
        opt._cur = c["cur"] % len(host.acc)
        for i, acc in enumerate(host.acc):
            acc.copy_(h["acc"]) if i == opt._cur else acc.zero_()
        if "upload" in h and host.upload is not None:
            host.upload.copy_(h["upload"])
        host.device_owned.zero_()
        for s in opt._selectable:
            if dev.index[s.index] is not None:
                host.set_device_owned(s, dev.index[s.index])
        opt._refresh_chunks()
    opt._policy.load_state_dict(sd["policy"])
    if opt._scaler is not None and sd["scaler"] is not None:
        opt._scaler.load_state_dict(sd["scaler"])
