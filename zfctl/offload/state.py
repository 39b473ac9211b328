"""The optimizer's complete state as one dict, for an exact resume (mid-interval, overlap on or off).

Each component saves and loads itself; this module assembles their dicts into the saved format
(``save``), checks, before anything is overwritten, that a dict fits the optimizer loading it, and
puts a dict back into the components (``load``). It works on the optimizer's public parts and
imports none of the engine's classes (the optimizer imports it), so there is no import cycle.

What is saved, beyond torch.optim's param_groups (lr & co., scheduler-visible):

* ``counters`` (``Pipeline``): steps taken, steps in the unfinished interval, the last interval's
  length, which slot set is current, whether a finished CPU update still waits to be
  installed; plus ``selected``: whether the first selection happened;
* ``selection`` and ``device`` (``DeviceAdam``): sorted column ids per matrix; fp32 master,
  moments and per-column step counters (flat, as laid out);
* ``host`` (``HostState`` + ``Pipeline``): fp32 master, moments and per-column counters
  (column-major) and the unfinished interval's raw fp32 gradient sum (``acc``: ``sum_t u_t g_t``,
  formed from its slots with the CPU update's rounding, slots.py; its clip factors' sum is
  ``counters.clip_sum``, marked ``raw_sums``: pipeline.py), as pieces (pieces.py);
* ``policy`` (``IntervalPolicy``) and ``scaler`` (``DynamicLossScaler``).

An update in flight is waited for first (a stall, at checkpoint time only); its result is then
"pending": the saved model params do not contain it yet, and the next boundary after loading
installs it exactly as the uninterrupted run would, from the master. Like ``torch.optim``, the
tensors are the live state, not copies (a checkpoint streams them to disk,
zfctl/train/tensorfile.py); take copies to keep a snapshot while training goes on. The host
paths' ``acc`` exists nowhere as a buffer (the slots hold the interval's steps): ``save`` forms
it into a new one (4 B per host element while the caller holds it), ``save(stream=True)`` (a
checkpoint written at once, ``ZenFlowOptimizer.checkpoint_state``) gives it as ``PartialSum``
pieces that form each chunk as the writer reads it (cpu/partial.py): no buffer of it at all. The layout depends on the parameter list, on ``topk_ratio`` and
on which matrices are split by row (``by_row``, from ``zenflow.vocab_select``; absent in older
states: none): loading into an optimizer that differs in any of them raises ValueError.

Data parallel: each rank's dict holds the replicated part (counters, selection, device state:
identical on every rank) and its own share of the host state as pieces keyed by parameter name
and column range (``pieces``), not by rank. ``partition`` records the world size, the rank, the
column cuts and ``ranges``: every rank's pieces as ``[name, owner, c0, c1]``, so a loader of any
world size knows which ranks' files hold the columns it needs. An optimizer loads any set of
pieces that covers its own columns, whichever world size wrote them.

Format 1 (before name-keyed pieces) held each rank's flat host buffers: it still loads into the
same rank of the same world size; anything else raises ValueError naming the world size to use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zfctl.offload.parallel.pieces import check_covers, gather_host, split_host

STATE_FORMAT = "zfctl.zenflow/2"
FORMAT_V1 = "zfctl.zenflow/1"  # flat per-rank host buffers: same rank and world size only


def pack_state(*, names: list[str], shapes: list[list[int]], by_row: list[str], config: dict[str, Any],
               param_groups: list[dict[str, Any]], partition: dict[str, Any], selected: bool,
               pipeline: dict[str, Any], device: dict[str, Any], host: list[dict[str, Any]] | None,
               scaler: dict[str, Any] | None) -> dict[str, Any]:
    """The saved format from the components' own state dicts (see the module docstring).

    ``host``: the host state as name-keyed pieces, the unfinished interval's sum
    included (``pieces.split_host``); ``pipeline``: its counters and policy.
    """
    device = dict(device)
    selection = device.pop("selection")
    return {
        "format": STATE_FORMAT,
        "names": list(names),
        "shapes": shapes,
        "by_row": list(by_row),
        "config": config,
        "param_groups": param_groups,
        "counters": {**pipeline["counters"], "selected": selected},
        "selection": selection,
        "device": device,
        "host": host,
        "policy": pipeline["policy"],
        "scaler": scaler,
        "partition": partition,
    }


def check_state(sd: dict[str, Any], *, names: list[str], shapes: list[list[int]], by_row: list[str],
                topk_ratio: float, partition: dict[str, Any]) -> None:
    """Raise ValueError (saying what differs) unless ``sd`` fits an optimizer with these properties."""
    if sd.get("format") not in (STATE_FORMAT, FORMAT_V1):
        raise ValueError(f"not a ZenFlow optimizer state (format {sd.get('format')!r}, expected {STATE_FORMAT!r})")
    for i, (name, shape) in enumerate(zip(names, shapes)):
        if i >= len(sd["names"]) or sd["names"][i] != name or sd["shapes"][i] != shape:
            raise ValueError(f"optimizer state does not match parameter {i} ({name!r}, shape {shape})")
    if len(sd["names"]) != len(names):
        raise ValueError(f"optimizer state has {len(sd['names'])} parameters, this optimizer {len(names)}")
    if sd["config"]["topk_ratio"] != topk_ratio:
        raise ValueError(f"optimizer state was saved with zenflow.topk_ratio={sd['config']['topk_ratio']}, "
                         f"this optimizer has {topk_ratio}; the state layout depends on it")
    saved_rows = sd.get("by_row", [])
    if sorted(saved_rows) != sorted(by_row):
        mode = sd["config"].get("vocab_select", "columns")
        raise ValueError(f"optimizer state was saved with zenflow.vocab_select={mode} (matrices split by row: "
                         f"{sorted(saved_rows) or 'none'}), this optimizer splits {sorted(by_row) or 'none'} by "
                         f"row; the state layout depends on it: resume with zenflow.vocab_select={mode}")
    saved = sd.get("partition") or {"world_size": 1, "rank": 0}
    mine = {k: partition[k] for k in ("world_size", "rank", "bounds") if k in partition}
    if sd["format"] == FORMAT_V1 and saved != mine:
        raise ValueError(
            f"optimizer state is rank {saved['rank']}'s slice of host state partitioned over "
            f"{saved['world_size']} rank(s), this is rank {partition['rank']} of {partition['world_size']}, "
            f"and its format ({FORMAT_V1}, flat per-rank buffers) cannot be re-cut: resume with "
            f"{saved['world_size']} process(es)")


def unpack_state(sd: dict[str, Any]) -> dict[str, Any]:
    """The components' dicts back out of the saved format (the inverse of ``pack_state``).

    ``host`` is a list of pieces (format 2) or, for format 1, the flat buffers with the
    accumulator and pending upload among them; ``pipeline`` holds the counters and the policy.
    """
    counters = dict(sd["counters"])
    selected = counters.pop("selected")
    return {"selected": selected, "pipeline": {"counters": counters, "policy": sd["policy"]},
            "device": {**sd["device"], "selection": sd["selection"]}, "host": sd["host"],
            "scaler": sd["scaler"], "param_groups": sd["param_groups"]}


def save(opt: Any, *, stream: bool = False) -> dict[str, Any]:
    """``opt.state_dict()``: the copies into the slots and an in-flight update waited for first,
    the unfinished interval's sum formed (``stream``: as it is read) and made canonical
    (``Pipeline.state_dict``), then assembled."""
    opt.drain()
    live = opt.gradient_path.live_acc if opt.host is not None else None
    pipeline = opt.pipeline.state_dict(live_acc=live, stream=stream)
    host = None
    if opt.host is not None:
        host = split_host(opt.layout, {**opt.host.state_dict(), "acc": pipeline.pop("acc")})
    sd = pack_state(
        names=opt.names, shapes=[list(p.shape) for p in opt.params], by_row=by_row(opt.layout),
        config=dataclasses.asdict(opt.config),
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        partition=opt.partition_info(), selected=opt.selector.selected, pipeline=pipeline,
        device=opt.device_state.state_dict(), host=host,
        scaler=opt.scaler.state_dict() if opt.scaler is not None else None)
    if opt.sharded is not None:  # FSDP2: this rank's rows, marked with its place in the group
        sd["fsdp_shard"] = [opt.sharded.rank, opt.sharded.world_size]
    return sd


def load(opt: Any, state_dict: dict[str, Any]) -> None:
    """``opt.load_state_dict()``: check, wait for a CPU update in flight (a live optimizer rolled
    back: it writes the host state), then copy into the live buffers piece by piece (values may
    be tensors or lazy file tensors: no gathered copy of the state). An FSDP2 state loads into the
    same rank and world size only."""
    here = [opt.sharded.rank, opt.sharded.world_size] if opt.sharded is not None else None
    saved = state_dict.get("fsdp_shard")
    if saved is not None:
        saved = [int(x) for x in saved]
    if saved != here:
        raise ValueError(f"optimizer state of FSDP2 shard (rank, world size) {saved} cannot load into "
                         f"{here}: sharded row states load into the same rank and world size only")
    state_dict = {k: v for k, v in state_dict.items() if k != "fsdp_shard"}
    check_state(state_dict, names=opt.names, shapes=[list(p.shape) for p in opt.params], by_row=by_row(opt.layout),
                topk_ratio=opt.config.topk_ratio, partition=opt.partition_info())
    parts = unpack_state(state_dict)
    opt.drain()
    if opt.host is not None:  # checked before anything is overwritten: a gap raises here
        host = parts["host"]
        pieces = host if isinstance(host, list) else split_host(opt.layout, host)  # format 1: flat
        check_covers(opt.layout, pieces)
    # A CPU update in flight (a live optimizer rolled back) writes master, moments and reads the
    # interval's slots: it must be done before any of them is overwritten below; its result is discarded.
    opt.pipeline.settle()
    opt.gradient_path.begin(final=False, slot=None)  # a half-armed window is void
    for group, saved in zip(opt.param_groups, parts["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    pipeline = parts["pipeline"]
    live = opt.gradient_path.live_acc if opt.host is not None else None
    if opt.host is not None:
        opt.host.wait_install()
        # The unfinished sum goes where the pipeline reads it: the device path's device buffer,
        # the carry layout's carry itself, or a new fp32 buffer the current slot set continues
        # from (its carry, 4 B per host element until that interval's update); none for an
        # interval without a step (slots.py / carry.py ``resume_buffer``).
        acc = live
        if acc is None and pipeline["counters"]["interval_len"]:
            acc = opt.host.grads.resume_buffer()
        gather_host(opt.layout, pieces, into={**opt.host.state_dict(), "acc": acc})
        opt.host.refresh_upload()  # a pending install reads the loaded master's rounding (host.py)
        pipeline["acc"] = acc
    opt.pipeline.load_state_dict(pipeline, live_acc=live)
    opt.selector.selected = parts["selected"]
    opt.device_state.load_state_dict(parts["device"])
    if opt.host is not None:
        opt.host.device_owned.zero_()
        for s in opt.selector.selectable:
            if (index := opt.device_state.index[s.index]) is not None:
                opt.host.set_device_owned(s, index)
        opt.transfers.replan()
    if opt.exchange is not None:
        opt.exchange.replan()  # the loaded selection's rounds, before the next backward's hooks
    if opt.scaler is not None and parts["scaler"] is not None:
        opt.scaler.load_state_dict(parts["scaler"])


def by_row(layout: Any) -> list[str]:
    """Names of the matrices split by row (layout.py), in parameter order."""
    return [s.name for s in layout.slots if s.by_row]


def partition_info(layout: Any, part: Any) -> dict[str, Any]:
    """Which share of the host state an optimizer holds (one process: all of it), and ``ranges``:
    every rank's pieces as [name, owner, c0, c1] (identical on every rank)."""
    if part is None:
        return {"world_size": 1, "rank": 0, "ranges": [[s.name, 0, 0, s.cols] for s in layout.host_slots]}
    names = [s.name for s in layout.slots]
    return {"world_size": part.world_size, "rank": part.rank, "bounds": list(part.bounds),
            "ranges": [[names[pc.index], pc.owner, pc.c0, pc.c1] for pc in part.pieces]}
