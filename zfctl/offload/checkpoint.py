"""The optimizer's complete state as one dict, for an exact resume (mid-interval, overlap on or off).

Each component saves and loads itself; this module only assembles their dicts into the saved
format and checks, before anything is overwritten, that a dict fits the optimizer loading it.
It imports none of the components (the optimizer imports it), so there is no import cycle.

What is saved, beyond torch.optim's param_groups (lr & co., scheduler-visible):

* ``counters`` (``Pipeline``): steps taken, steps in the unfinished interval, the last interval's
  length, which accumulator is current, whether a finished CPU update still waits to be
  installed; plus ``selected``: whether the first selection happened;
* ``selection`` and ``device`` (``DeviceAdam``): sorted column ids per matrix; fp32 master,
  moments and per-column step counters (flat, as laid out);
* ``host`` (``HostState`` + ``Pipeline``): fp32 master, moments and per-column counters
  (column-major), the accumulator of the unfinished interval, and, when an update is pending,
  the bf16/fp16 values it will install;
* ``policy`` (``IntervalPolicy``) and ``scaler`` (``DynamicLossScaler``).

An update in flight is waited for first (a stall, at checkpoint time only); its result is then
"pending": the saved model params do not contain it yet, and the next boundary after loading
installs it exactly as the uninterrupted run would. Tensors are CPU copies, so the dict stays
valid while training continues. The layout depends on the parameter list and on ``topk_ratio``:
loading into an optimizer that differs in either raises ValueError.

Data parallel: each rank's dict holds the replicated part (counters, selection, device state:
identical on every rank) and its own slice of the host state; ``partition`` records the world
size, the rank and the column cuts. Loading a slice into a different world size or rank raises
ValueError: the slices would have to be re-cut (concatenate the ranks' host buffers in rank order
and split them again), which is not implemented.
"""

from __future__ import annotations

from typing import Any

STATE_FORMAT = "zfctl.zenflow/1"


def pack_state(*, names: list[str], shapes: list[list[int]], config: dict[str, Any],
               param_groups: list[dict[str, Any]], partition: dict[str, Any], selected: bool,
               pipeline: dict[str, Any], device: dict[str, Any], host: dict[str, Any] | None,
               scaler: dict[str, Any] | None) -> dict[str, Any]:
    """The saved format from the components' own state dicts (see the module docstring)."""
    device = dict(device)
    selection = device.pop("selection")
    host_sd = None
    if host is not None:
        host_sd = {**host, "acc": pipeline["acc"]}
        if "upload" in pipeline:
            host_sd["upload"] = pipeline["upload"]
    return {
        "format": STATE_FORMAT,
        "names": list(names),
        "shapes": shapes,
        "config": config,
        "param_groups": param_groups,
        "counters": {**pipeline["counters"], "selected": selected},
        "selection": selection,
        "device": device,
        "host": host_sd,
        "policy": pipeline["policy"],
        "scaler": scaler,
        "partition": partition,
    }


def check_state(sd: dict[str, Any], *, names: list[str], shapes: list[list[int]], topk_ratio: float,
                partition: dict[str, Any]) -> None:
    """Raise ValueError (saying what differs) unless ``sd`` fits an optimizer with these properties."""
    if sd.get("format") != STATE_FORMAT:
        raise ValueError(f"not a ZenFlow optimizer state (format {sd.get('format')!r}, expected {STATE_FORMAT!r})")
    for i, (name, shape) in enumerate(zip(names, shapes)):
        if i >= len(sd["names"]) or sd["names"][i] != name or sd["shapes"][i] != shape:
            raise ValueError(f"optimizer state does not match parameter {i} ({name!r}, shape {shape})")
    if len(sd["names"]) != len(names):
        raise ValueError(f"optimizer state has {len(sd['names'])} parameters, this optimizer {len(names)}")
    if sd["config"]["topk_ratio"] != topk_ratio:
        raise ValueError(f"optimizer state was saved with zenflow.topk_ratio={sd['config']['topk_ratio']}, "
                         f"this optimizer has {topk_ratio}; the state layout depends on it")
    saved = sd.get("partition") or {"world_size": 1, "rank": 0}
    if saved != partition:
        raise ValueError(
            f"optimizer state is rank {saved['rank']}'s slice of host state partitioned over "
            f"{saved['world_size']} rank(s), this is rank {partition['rank']} of {partition['world_size']}: "
            f"resume with {saved['world_size']} process(es) (resharding is not supported)")


def unpack_state(sd: dict[str, Any]) -> dict[str, Any]:
    """The components' dicts back out of the saved format (the inverse of ``pack_state``)."""
    counters = dict(sd["counters"])
    selected = counters.pop("selected")
    host = sd["host"]
    pipeline: dict[str, Any] = {"counters": counters, "policy": sd["policy"]}
    host_sd = None
    if host is not None:
        host_sd = {k: v for k, v in host.items() if k not in ("acc", "upload")}
        pipeline["acc"] = host["acc"]
        if "upload" in host:
            pipeline["upload"] = host["upload"]
    return {"selected": selected, "pipeline": pipeline, "device": {**sd["device"], "selection": sd["selection"]},
            "host": host_sd, "scaler": sd["scaler"], "param_groups": sd["param_groups"]}
