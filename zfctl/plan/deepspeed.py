"""Import a DeepSpeed JSON config (`--config ds_config.json`) as a plan fragment.

People arrive with the config that runs ZenFlow in DeepSpeed (e.g. DeepSpeedExamples'
`zf_config.json`). We map every key that has a meaning here and report every other key by name:
a key whose *behaviour* we cannot reproduce (ZeRO-3, NVMe offload, a non-Adam optimizer, a static
fp16 loss scale) is an error; a key that only tunes DeepSpeed's own machinery (bucket sizes,
overlap_comm, print cadence) is listed as ignored. Nothing is dropped silently.

Where DeepSpeed's defaults differ from ours, an absent key means what it means in DeepSpeed: a
`zenflow` block without `overlap_step` runs synchronously and without `update_interval` is
'auto', selects once per epoch (`select_interval: auto`), has no warm-up rounds, never scales
the CPU step (`deferred_lr_scale: off`), splits the embedding and output head by columns like
every weight (`vocab_select: columns`) and installs each CPU update at the next boundary
(`tuning.install_lag: 0`); a config with CPU optimizer offload but no `zenflow` block is plain
ZeRO-Offload (topk_ratio 0, update_interval 1); a config without optimizer offload keeps
everything on the device (topk_ratio 1). DeepSpeed's `select_strategy` + `select_interval` become
one `zenflow.select_interval` (zfctl/plan/legacy.py), `auto_ratio` and `pin_memory` are
`zenflow.tuning.*`: a note names each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zfctl.errors import ConfigError
from zfctl.plan.coerce import suggest
from zfctl.plan.legacy import select_interval

# Keys whose only effect is on DeepSpeed's own engine; zfctl has no equivalent to tune.
_IGNORED_TOP = {
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "dump_state",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "memory_breakdown",
    "flops_profiler",
    "csv_monitor",
    "comms_logger",
    "sparse_gradients",
    "zero_force_ds_cpu_optimizer",
    "timers",
    "data_types",
    "seq_parallel_communication_data_type",
}
_IGNORED_ZERO = {
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "reduce_bucket_size",
    "allgather_partitions",
    "allgather_bucket_size",
    "round_robin_gradients",
    "sub_group_size",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "use_multi_rank_bucket_allreduce",
    "ignore_unused_parameters",
    "cpu_offload",
    "stage3_gather_16bit_weights_on_model_save",
}
_IGNORED_OFFLOAD = {"buffer_count", "fast_init", "ratio", "nvme_path", "pipeline_read", "pipeline_write"}
# DeepSpeed's zenflow keys -> zfctl's (select_strategy and select_interval are read as a pair).
_ZENFLOW_KEYS = {
    "topk_ratio": "zenflow.topk_ratio",
    "select_strategy": "zenflow.select_interval",
    "select_interval": "zenflow.select_interval",
    "update_interval": "zenflow.update_interval",
    "full_warm_up_rounds": "zenflow.full_warm_up_rounds",
    "overlap_step": "zenflow.overlap_step",
    "auto_ratio": "zenflow.tuning.auto_ratio",
}
_ZENFLOW_IGNORED = {"pt_reserved_cores_perc": "zfctl sizes its CPU pool with zenflow.cpu_threads"}
_KNOWN_TOP = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16",
    "fp16",
    "optimizer",
    "scheduler",
    "zero_optimization",
    "tensorboard",
    "wandb",
} | _IGNORED_TOP
_SCHEDULES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def looks_like_deepspeed(data: dict) -> bool:
    """True for a DeepSpeed config: DeepSpeed keys at the top, or no plan section at all.

    A JSON file with plan sections (`train`, `zenflow`, ...) is a plan fragment instead.
    """
    from zfctl.plan.schema import SECTIONS

    keys = set(data)
    return bool(keys & _KNOWN_TOP) or not (keys & set(SECTIONS))


@dataclass
class DeepSpeedImport:
    """The plan fragment and the ignored keys, each note naming a DeepSpeed key."""

    fragment: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def put(self, dotted: str, value: Any) -> None:
        *parents, key = dotted.split(".")
        where = self.fragment
        for name in parents:
            where = where.setdefault(name, {})
        where[key] = value

    def mapped(self, key: str, dotted: str) -> None:
        """A note for a DeepSpeed key whose zfctl name is not its own."""
        self.notes.append(f"DeepSpeed key {key} read as {dotted}")

    def ignore(self, key: str, why: str = "no effect in zfctl") -> None:
        self.notes.append(f"DeepSpeed key {key} ignored: {why}")


def _mapping(value: Any, key: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(key, value, "expected a JSON object")
    return value


def _enabled(section: Any, key: str) -> Any:
    """DeepSpeed's `{"enabled": ...}` flag: True, False, or 'auto'."""
    value = _mapping(section, key).get("enabled", False)
    if value not in (True, False, "auto"):
        raise ConfigError(f"{key}.enabled", value, "expected true or false")
    return value


def _precision(ds: dict, out: DeepSpeedImport) -> None:
    bf16 = _enabled(ds["bf16"], "bf16") if "bf16" in ds else None
    fp16 = _enabled(ds["fp16"], "fp16") if "fp16" in ds else None
    if bf16 is True and fp16 is True:
        raise ConfigError("bf16.enabled", True, "fp16.enabled is also true; enable only one of bf16, fp16")
    if bf16 is True:
        out.put("train.precision", "bf16")
    elif fp16 is True:
        out.put("train.precision", "fp16")
    elif bf16 is False or fp16 is False:
        out.put("train.precision", "fp32")  # an explicit 'disabled' means DeepSpeed's fp32 default
    for name in ("bf16", "fp16"):
        for key in set(ds.get(name, {})) - {"enabled"}:
            if name == "fp16" and key == "loss_scale" and ds["fp16"][key] not in (0, 0.0):
                raise ConfigError(
                    "fp16.loss_scale",
                    ds["fp16"][key],
                    "zfctl uses dynamic loss scaling only; set 0 or remove the key",
                )
            out.ignore(f"{name}.{key}", "zfctl's dynamic loss scaler uses its own settings")


def _optimizer(ds: dict, out: DeepSpeedImport) -> None:
    opt = _mapping(ds["optimizer"], "optimizer")
    kind = str(opt.get("type", "AdamW"))
    if kind.lower() not in ("adam", "adamw", "cpuadam", "deepspeedcpuadam", "fusedadam"):
        raise ConfigError("optimizer.type", kind, "zfctl runs AdamW on both paths; use Adam or AdamW")
    extra = sorted(set(opt) - {"type", "params"})
    if extra:
        raise ConfigError(
            f"optimizer.{extra[0]}", opt[extra[0]], "unsupported DeepSpeed optimizer key; remove it"
        )
    names = {
        "lr": "train.lr",
        "betas": "train.betas",
        "eps": "train.eps",
        "weight_decay": "train.weight_decay",
    }
    for key, value in _mapping(opt.get("params", {}), "optimizer.params").items():
        if key in names:
            if value != "auto":
                out.put(names[key], value)
        elif key == "adam_w_mode":
            if value is not True:
                raise ConfigError(
                    "optimizer.params.adam_w_mode",
                    value,
                    "zfctl applies decoupled weight decay (AdamW); set true or remove it",
                )
        elif (key, value) in (("bias_correction", True), ("amsgrad", False)):
            out.ignore(f"optimizer.params.{key}", "already zfctl's behaviour")
        elif key in ("torch_adam", "fused"):
            out.ignore(f"optimizer.params.{key}", "zfctl picks its own kernels")
        else:
            raise ConfigError(
                f"optimizer.params.{key}", value, f"unsupported optimizer parameter{suggest(key, names)}"
            )


def _scheduler(ds: dict, out: DeepSpeedImport) -> None:
    sched = _mapping(ds["scheduler"], "scheduler")
    kind = sched.get("type")
    if kind not in _SCHEDULES:
        raise ConfigError(
            "scheduler.type", kind, f"use one of {', '.join(_SCHEDULES)} (or remove the scheduler)"
        )
    out.put("train.schedule", _SCHEDULES[kind])
    for key, value in _mapping(sched.get("params", {}), "scheduler.params").items():
        if value == "auto":
            continue
        if key == "warmup_num_steps":
            out.put("train.warmup_steps", value)
        elif key == "warmup_max_lr":
            out.put("train.lr", value)
        elif key == "total_num_steps":
            out.put("train.max_steps", value)
        elif key in ("warmup_min_lr", "warmup_type", "warmup_min_ratio", "cos_min_ratio"):
            out.ignore(f"scheduler.params.{key}", "zfctl warms up linearly from 0 and decays to 0")
        else:
            raise ConfigError(f"scheduler.params.{key}", value, "unsupported scheduler parameter")


def _zero(ds: dict, out: DeepSpeedImport) -> None:
    zero = _mapping(ds.get("zero_optimization", {}), "zero_optimization")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2):
        raise ConfigError(
            "zero_optimization.stage",
            stage,
            "zfctl implements ZenFlow for stage 1/2-style data parallelism; use 2",
        )
    if "offload_param" in zero:
        raise ConfigError(
            "zero_optimization.offload_param",
            zero["offload_param"],
            "parameter offload is not supported; only optimizer offload (offload_optimizer)",
        )
    off = _mapping(zero.get("offload_optimizer", {}), "zero_optimization.offload_optimizer")
    device = off.get("device", "none")
    if device not in ("cpu", "none"):
        raise ConfigError(
            "zero_optimization.offload_optimizer.device", device, "zfctl offloads to CPU memory only; use cpu"
        )
    if "pin_memory" in off:
        out.put("zenflow.tuning.pin_memory", off["pin_memory"])
        out.mapped("zero_optimization.offload_optimizer.pin_memory", "zenflow.tuning.pin_memory")
    for key in set(off) - {"device", "pin_memory"}:
        if key not in _IGNORED_OFFLOAD:
            raise ConfigError(
                f"zero_optimization.offload_optimizer.{key}", off[key], "unsupported key; remove it"
            )
        out.ignore(f"zero_optimization.offload_optimizer.{key}")
    for key in set(zero) - {"stage", "offload_optimizer", "zenflow"}:
        if key not in _IGNORED_ZERO:
            raise ConfigError(
                f"zero_optimization.{key}",
                zero[key],
                f"unsupported ZeRO key{suggest(key, _IGNORED_ZERO | {'zenflow', 'offload_optimizer'})}",
            )
        out.ignore(f"zero_optimization.{key}")

    if "zenflow" in zero:
        if device != "cpu":
            raise ConfigError(
                "zero_optimization.offload_optimizer.device",
                device,
                "ZenFlow needs CPU optimizer offload; set offload_optimizer.device to cpu",
            )
        zf = _mapping(zero["zenflow"], "zero_optimization.zenflow")
        # DeepSpeed's defaults for the keys the block leaves out (ours differ; see module doc).
        out.put("zenflow.overlap_step", False)
        out.put("zenflow.update_interval", "auto")
        # Selection and warm-up as DeepSpeed does them, and its uncorrected CPU step (zfctl's
        # defaults differ; a DeepSpeed config should run as it does there).
        out.put("zenflow.select_interval", "auto")
        out.put("zenflow.full_warm_up_rounds", 0)
        out.put("zenflow.deferred_lr_scale", "off")
        out.put("zenflow.vocab_select", "columns")  # DeepSpeed splits embeddings by hidden dimension
        out.put("zenflow.tuning.install_lag", 0)  # and installs each update at the next boundary
        for key, value in zf.items():
            if key in ("select_strategy", "select_interval"):
                continue
            if key in _ZENFLOW_KEYS:
                out.put(_ZENFLOW_KEYS[key], value)
                if _ZENFLOW_KEYS[key] != f"zenflow.{key}":
                    out.mapped(f"zero_optimization.zenflow.{key}", _ZENFLOW_KEYS[key])
            elif key in _ZENFLOW_IGNORED:
                out.ignore(f"zero_optimization.zenflow.{key}", _ZENFLOW_IGNORED[key])
            else:
                raise ConfigError(
                    f"zero_optimization.zenflow.{key}",
                    value,
                    f"unsupported ZenFlow key{suggest(key, _ZENFLOW_KEYS)}",
                )
        if "select_strategy" in zf:  # DeepSpeed's default interval is 'auto'
            new = select_interval(zf["select_strategy"], zf.get("select_interval", "auto"), DS_ZENFLOW)
            out.put("zenflow.select_interval", new)
            out.mapped(f"zero_optimization.zenflow.select_strategy={zf['select_strategy']} with select_interval="
                       f"{zf.get('select_interval', 'auto')}", f"zenflow.select_interval={new}")
        elif "select_interval" in zf:  # DeepSpeed's default strategy is 'auto': an integer counts epochs
            new = select_interval("auto", zf["select_interval"], DS_ZENFLOW)
            out.put("zenflow.select_interval", new)
            if new != zf["select_interval"]:
                out.mapped(f"zero_optimization.zenflow.select_interval={zf['select_interval']}",
                           f"zenflow.select_interval={new}")
    elif device == "cpu":
        out.put("zenflow.topk_ratio", 0.0)  # plain ZeRO-Offload: every step through the CPU
        out.put("zenflow.update_interval", 1)
        out.put("zenflow.overlap_step", False)
    else:
        out.put("zenflow.topk_ratio", 1.0)  # no offload: the whole optimizer on the device


DS_ZENFLOW = "zero_optimization.zenflow"  # where a DeepSpeed config keeps the ZenFlow keys


def from_deepspeed(ds: dict) -> DeepSpeedImport:
    """Map a DeepSpeed config dict onto a plan fragment (raises ConfigError on unsupported keys)."""
    out = DeepSpeedImport()
    for key, value in ds.items():
        if key not in _KNOWN_TOP:
            raise ConfigError(key, value, f"unsupported DeepSpeed key{suggest(key, _KNOWN_TOP)}")
        if key in _IGNORED_TOP:
            out.ignore(key)
    micro = ds.get("train_micro_batch_size_per_gpu")
    accum = ds.get("gradient_accumulation_steps")
    for key, dotted in (
        ("train_micro_batch_size_per_gpu", "train.micro_batch_size"),
        ("gradient_accumulation_steps", "train.gradient_accumulation_steps"),
    ):
        if ds.get(key, "auto") != "auto":
            out.put(dotted, ds[key])
    total = ds.get("train_batch_size", "auto")
    if total != "auto":
        if micro in (None, "auto"):
            per_proc = total // (accum if isinstance(accum, int) and accum > 0 else 1)
            out.put("train.micro_batch_size", per_proc)
            out.notes.append(
                f"DeepSpeed train_batch_size {total} read as micro_batch_size {per_proc} for one process"
            )
        else:
            out.ignore(
                "train_batch_size",
                "the global batch is micro_batch_size x gradient_accumulation_steps x distributed.nproc",
            )
    if ds.get("gradient_clipping", "auto") != "auto":  # "auto" (HF Trainer style): keep the plan's
        clip = ds["gradient_clipping"]
        out.put("train.max_grad_norm", None if clip in (0, 0.0) else clip)  # DeepSpeed: 0 = off
    _precision(ds, out)
    if "optimizer" in ds:
        _optimizer(ds, out)
    if "scheduler" in ds:
        _scheduler(ds, out)
    _zero(ds, out)
    for name in ("tensorboard", "wandb"):
        if name in ds:
            section = _mapping(ds[name], name)
            out.put(f"logging.{name}", bool(section.get("enabled", False)))
            if name == "wandb" and "project" in section:
                out.put("logging.wandb_project", section["project"])
            for key in set(section) - {"enabled", "project"}:
                out.ignore(f"{name}.{key}")
    return out
