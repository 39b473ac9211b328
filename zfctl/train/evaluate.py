"""`evaluate`: score a fine-tuned model on data in its run's format, and on lm-eval-harness tasks.

The data goes through the pipeline training reads it with (zfctl/train/data/prepare.py): the
run's template, fields and ``max_length``, never packed, so each record is one sequence whose
labels mark its answer. Three numbers come of it:

- **loss**: the mean next-token cross-entropy over the target tokens (labels != -100), summed and
  divided as the training loop's evaluation does (zfctl/train/loss.py, ``evaluate``);
- **perplexity**: exp(loss), the same mean per token;
- **exact-match**: the share of records whose greedy answer equals the reference after stripping
  whitespace. The prompt is the record's tokens up to its last trained span (the whole training
  prompt: alpaca's input, a chat's earlier turns and system turn), the reference that span decoded
  without special tokens, so the answer is compared with what training taught for that prompt.
  Template text has no prompt, so no exact-match.

The tasks go to lm-eval-harness through its Python API (``lm_eval.simple_evaluate`` on an HFLM
wrapping the loaded model), an optional extra (``pip install 'zfctl[eval]'``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zfctl.errors import UserError
from zfctl.plan.io import load_plan_yaml
from zfctl.plan.schema import DataConfig, RunPlan
from zfctl.train import checkpoint as ck
from zfctl.train.checkpoint.find import step_dirs
from zfctl.train.data.templates import IGNORE_INDEX, RecordError
from zfctl.train.generate import Generator, is_export

if TYPE_CHECKING:
    from zfctl.train.data.prepare import PreparedData

EVAL_EXTRA = "pip install 'zfctl[eval]'"


@dataclass
class Answer:
    """One record's greedy answer against its reference."""

    prompt: str
    reference: str
    answer: str
    match: bool


@dataclass
class Scores:
    """What ``zfctl evaluate`` prints and writes with ``--json``."""

    data: str
    examples: int
    target_tokens: int
    loss: float
    perplexity: float
    exact_match: float | None  # None: template text (no prompt to answer)
    answers: list[Answer] = field(default_factory=list)


def checkpoint_path(run: Path, checkpoint: str | None) -> Path:
    """What ``--checkpoint`` picks: ``run`` itself (its newest checkpoint, as ``zfctl generate``
    loads it) when not given, a step number of ``run``'s checkpoints, or a checkpoint folder."""
    if checkpoint is None:
        return run
    if checkpoint.strip().isdigit():
        steps = sorted(step_dirs(run / ck.CHECKPOINTS)) if (run / ck.CHECKPOINTS).is_dir() else []
        found = [p for s, p in steps if s == int(checkpoint)]
        if not found:
            have = ", ".join(str(s) for s, _ in steps) or "none"
            raise UserError(f"--checkpoint {checkpoint}: {run} has no checkpoint of that step (steps there: {have}); "
                            "give one of those, or a checkpoint folder")
        return found[0]
    path = Path(checkpoint)
    if not (path / ck.META).is_file():
        raise UserError(f"--checkpoint {checkpoint}: not a step number of {run}'s checkpoints nor a checkpoint folder "
                        f"(a checkpoints/step-XXXXXX folder holding {ck.META})")
    return path


def run_plan(path: Path) -> RunPlan:
    """The plan ``path`` (a run, checkpoint or zfctl export folder) trained with."""
    if is_export(path):
        plan_file = path / "zfctl-plan.yaml"
        if not plan_file.is_file():
            raise UserError(f"{path} holds no zfctl-plan.yaml, so its data format is unknown; give the run folder, "
                            "or an export written by zfctl export")
        return load_plan_yaml(plan_file)
    return load_plan_yaml(ck.resolve_checkpoint(path).path / ck.PLAN_FILE)


def eval_config(data: DataConfig, file: Path | None, limit: int | None) -> DataConfig:
    """The run's data config reading ``file`` (None: the run's own validation split) whole, as
    one split, unpacked, its first ``limit`` records."""
    from zfctl.train.data.source import SUFFIXES, resolve

    if file is None:
        if not data.validation_split:
            raise UserError("--data: not given, and the run's plan names no validation data (data.validation_split "
                            "is null: its eval records were held out of the training data); give --data FILE")
        if data.source == "hub":
            where: dict[str, Any] = {"split": data.validation_split}
        else:
            eval_file = resolve(data).eval
            assert eval_file is not None, "resolve names a file for a validation_split"
            where = {"source": "local", "path": eval_file, "split": "train"}
    else:
        if not file.is_file():
            raise UserError(f"--data {file}: no such file; give a .json/.jsonl/.csv/.parquet file in the run's format "
                            f"(data.template={data.template})")
        if file.suffix.lower() not in SUFFIXES:
            raise UserError(f"--data {file}: unsupported file type; use .json, .jsonl, .csv or .parquet")
        where = {"source": "local", "path": str(file), "split": "train"}
    return dataclasses.replace(data, **where, validation_split=None, validation_fraction=0.0, start_idx=0,
                               end_idx=limit, packing=False)


def check_format(cfg: DataConfig, file: Path) -> None:
    """The first record of ``file`` rendered with the run's template: a file in another format is
    refused in one line naming the template, before the model loads."""
    from zfctl.train.data.chat import normalize
    from zfctl.train.data.source import first_record
    from zfctl.train.data.templates import render

    rec = first_record(file)
    try:
        if cfg.template == "chat":
            normalize(rec, str(file), 0)
        elif rec is not None:
            render(rec, cfg, str(file), 0)
    except RecordError as e:
        raise wrong_format(e, cfg) from None


def wrong_format(e: RecordError, cfg: DataConfig) -> UserError:
    """A bad record's line for ``--data``. The pipeline's hint to map a field with --set belongs to
    training: here the run's format is fixed, and the file is what must change."""
    problem = str(e).split("; if another field holds it")[0]
    return UserError(f"--data: {problem}: the file is not in the format the run trained on "
                     f"(data.template={cfg.template}); give records in that format")


def prepare(gen: Generator, cfg: DataConfig, plan: RunPlan) -> PreparedData:
    """The records ``cfg`` reads (:func:`eval_config`), tokenised by the training pipeline with the
    loaded tokenizer (and cached as training data is)."""
    from zfctl.train.data.prepare import prepare_data

    try:
        return prepare_data(cfg, gen.tokenizer, seed=plan.train.seed)
    except RecordError as e:  # a later record than the first (check_format) in another shape
        raise wrong_format(e, cfg) from None


def score(gen: Generator, prepared: PreparedData, cfg: DataConfig, plan: RunPlan, *, max_new_tokens: int,
          on_answer: Callable[[int, int], None] | None = None) -> Scores:
    """Loss, perplexity and exact-match of ``gen`` on ``prepared`` (:func:`prepare`).
    ``on_answer(done, total)`` is called after each generated answer (a progress bar)."""
    from zfctl.train.loss import evaluate

    rows = prepared.train
    device = gen.model.device
    mb = plan.train.micro_batch_size
    loss = evaluate(gen.model, rows, prepared.collate, device, micro_batch_size=mb, max_batches=len(rows))
    n_targets = sum(sum(1 for x in labels[1:] if x != IGNORE_INDEX) for labels in rows["labels"])  # as targets()
    assert loss is not None, "prepare_data refuses data without a trained token"
    where = cfg.path if cfg.source == "local" else f"{cfg.path or cfg.name} split {cfg.split}"
    scores = Scores(str(where), len(rows), n_targets, loss, math.exp(loss), None)
    if cfg.template == "text":
        return scores
    for k in range(len(rows)):
        prompt, reference = split_answer(rows[k]["input_ids"], rows[k]["labels"])
        new = gen.continue_ids(prompt, max_new_tokens=max_new_tokens, temperature=0.0)
        decode = gen.tokenizer.decode
        answer = str(decode(new, skip_special_tokens=True))
        ref = str(decode(reference, skip_special_tokens=True))
        scores.answers.append(Answer(str(decode(prompt, skip_special_tokens=True)), ref, answer,
                                     answer.strip() == ref.strip()))
        if on_answer is not None:
            on_answer(k + 1, len(rows))
    scores.exact_match = sum(a.match for a in scores.answers) / len(scores.answers)
    return scores


def split_answer(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(prompt, reference) of one sequence: the tokens before its last trained span, and that span."""
    end = max(i for i, x in enumerate(labels) if x != IGNORE_INDEX) + 1
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return list(ids[:start]), list(ids[start:end])


def lm_eval_module() -> Any:
    """The lm_eval package, or one line naming the extra that installs it."""
    try:
        import lm_eval
    except ImportError:
        raise UserError(f"--task needs the lm-eval package (lm-eval-harness), which is not installed; install it "
                        f"with {EVAL_EXTRA}") from None
    return lm_eval


def run_tasks(gen: Generator, tasks: list[str], *, limit: int | None) -> dict[str, dict[str, float]]:
    """lm-eval-harness ``tasks`` on the loaded model: per task, its numeric metrics
    (``acc,none``: 0.52, ...) as ``lm_eval.simple_evaluate`` reports them."""
    lm_eval = lm_eval_module()
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=gen.model, tokenizer=gen.tokenizer, batch_size=1)
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit)
    except (KeyError, ValueError) as e:  # an unknown task name: lm-eval's own message names it
        first = str(e.args[0] if e.args else e).strip().splitlines()[0]
        raise UserError(f"--task {','.join(tasks)}: {first}; list the tasks with `lm-eval ls tasks`") from None
    results = (out or {}).get("results", {})
    return {task: {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for task, metrics in results.items()}


def model_device() -> torch.device:
    """Where the model runs: the GPU when there is one (as ``zfctl generate``), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
