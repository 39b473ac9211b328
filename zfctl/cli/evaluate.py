"""`zfctl evaluate RUN [--data FILE] [--task NAME,...]`: loss, perplexity and exact-match of a
fine-tuned model, and lm-eval-harness tasks (the work: zfctl/train/evaluate.py)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from zfctl.cli._common import VerboseOpt, console, dumps_json, err_console, note_line
from zfctl.errors import UserError

if TYPE_CHECKING:  # the engine loads inside the command: `zfctl --help` stays light
    from zfctl.plan.schema import DataConfig, RunPlan
    from zfctl.train.data.prepare import PreparedData
    from zfctl.train.evaluate import Scores
    from zfctl.train.generate import Generator


def evaluate(
    run: Annotated[
        Path,
        typer.Argument(exists=True, metavar="RUN",
                       help="A run folder (its newest checkpoint), a checkpoint folder, or a zfctl export folder."),
    ],
    data: Annotated[
        Path | None,
        typer.Option("--data", "-d", metavar="FILE",
                     help="A .json/.jsonl/.csv/.parquet file in the run's format (its data.template and fields); "
                     "default: the run's validation data (data.validation_split)."),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option("--task", metavar="NAME[,NAME]",
                     help="lm-eval-harness tasks to run on the model (needs pip install 'zfctl\\[eval]'); with "
                     "--task and no --data, only the tasks run."),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, metavar="N", help="Score only the first N examples (per task).")
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="Stop each generated answer after this many tokens "
                          "(or at EOS).")
    ] = 128,
    checkpoint: Annotated[
        str | None,
        typer.Option("--checkpoint", metavar="STEP|PATH",
                     help="A step of RUN's checkpoints or a checkpoint folder; default: the newest, as generate "
                     "loads it."),
    ] = None,
    json_out: Annotated[
        Path | None,
        typer.Option("--json", metavar="FILE", help="Also write the scores (and each answer) to FILE as JSON."),
    ] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Score a fine-tuned model: loss and perplexity over the answer tokens (as training computes its
    loss) and exact-match of its greedy answers (whitespace stripped), on data in its run's format."""
    from zfctl.quiet import set_verbose

    set_verbose(verbose)  # before transformers loads (zfctl.train.evaluate imports it): its bars read this once
    from zfctl.train import evaluate as ev

    tasks = [t.strip() for t in task.split(",") if t.strip()] if task is not None else []
    if task is not None and not tasks:
        raise UserError("--task is empty; give lm-eval-harness task names, e.g. --task hellaswag,arc_easy")
    if json_out is not None and not json_out.parent.is_dir():  # refused now, not after the scoring
        raise UserError(f"--json {json_out}: the folder {json_out.parent} does not exist; create it or give "
                        "another file")
    if tasks:
        ev.lm_eval_module()  # the missing extra is one line before anything loads
    path = ev.checkpoint_path(run, checkpoint)
    plan = ev.run_plan(path)
    cfg = None
    if data is not None or not tasks:
        cfg = ev.eval_config(plan.data, data, limit)
        if cfg.source == "local":
            ev.check_format(cfg, Path(str(cfg.path)))
    from zfctl.train.checkpoint import use_checkpoint_with
    from zfctl.train.generate import load_generator

    # a damaged checkpoint's line names this command on an intact one (evaluate has no --latest-good)
    asked = f" --data {shlex.quote(str(data))}" if data is not None else ""
    use_checkpoint_with(lambda ckpt: f"zfctl evaluate {shlex.quote(str(ckpt))}{asked}")
    notes: list[str] = []
    gen = load_generator(path, ev.model_device(), notes)
    for line in notes:
        note_line(line)
    prepared = ev.prepare(gen, cfg, plan) if cfg is not None else None  # a bad record: its line alone
    console.print(f"model: {gen.source}", style="dim", highlight=False, soft_wrap=True)
    result: dict = {"model": gen.source}
    if cfg is not None and prepared is not None:
        scores = _score(gen, prepared, cfg, plan, max_new_tokens)
        result.update(dataclasses.asdict(scores))
    if tasks:
        with err_console.status(f"lm-eval-harness: {', '.join(tasks)}"):
            found = ev.run_tasks(gen, tasks, limit=limit)
        for name, metrics in found.items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            console.print(Text(f"task {name}: ", style="bold") + Text(shown or "no numeric metric"), soft_wrap=True)
        result["tasks"] = found
    if json_out is not None:
        json_out.write_text(dumps_json(result) + "\n", encoding="utf-8")
        console.print(f"scores written to {json_out}", style="dim", highlight=False, soft_wrap=True)


def _score(gen: Generator, prepared: PreparedData, cfg: DataConfig, plan: RunPlan, max_new_tokens: int) -> Scores:
    """Score ``prepared`` with a progress bar over the generated answers; print the result."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from zfctl.train import evaluate as ev

    with Progress(TextColumn("answering"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
        job = bar.add_task("answering", total=None)
        scores = ev.score(gen, prepared, cfg, plan, max_new_tokens=max_new_tokens,
                          on_answer=lambda done, total: bar.update(job, completed=done, total=total))
    console.print(f"data: {scores.data}: {scores.examples:,} examples (data.template={cfg.template}), "
                  f"{scores.target_tokens:,} target tokens", highlight=False, soft_wrap=True)
    line = (Text("loss ", style="bold") + Text(f"{scores.loss:.4f}") + Text("  perplexity ", style="bold")
            + Text(f"{scores.perplexity:,.3f}") + Text("  exact-match ", style="bold"))
    if scores.exact_match is None:
        line += Text("n/a (data.template=text has no prompt to answer)", style="dim")
    else:
        matched = sum(a.match for a in scores.answers)
        line += Text(f"{matched}/{len(scores.answers)} ({scores.exact_match:.1%})")
    console.print(line, soft_wrap=True)
    return scores
