"""Accuracy harness: does ZenFlow learn as fast as AdamW per step when fine-tuning a pretrained model?

    OMP_NUM_THREADS=1 python scripts/accuracy.py                      # the table (tiny base, CPU)
    OMP_NUM_THREADS=1 python scripts/accuracy.py --variant sel16=paper+zenflow.select_interval=16 \\
        --variant adamw=off                                            # a study: any preset + --set keys
    python scripts/accuracy.py --model smollm2-135m --steps 100 --tasks instruct,sst2  # optional extra

Everything goes through the real engine (``zfctl.plan.resolve_plan`` + ``zfctl.train.run``, the
code path of ``zfctl finetune``), same seeds, same batches, same steps for every variant. Each task
runs once per fine-tuning seed (``--seeds``, ``--sst2-seeds``; the base keeps ``--seed``) and the
table shows the mean: on sst2 one seed moves a variant's accuracy by up to 10 points, far more
than the 1 point the acceptance asks for, so one seed cannot rank variants there. ``--jobs`` runs
that many fine-tunes at a time (one process each, ``--threads`` threads each; default 2: the
2-core development machine), so ms/step is a shared-CPU number, not a speed measurement.

1. A small *pretrained* base, made once and cached (``<cache>/base-*``): tiny-llama trained from
   random init with plain AdamW (``--zenflow off``) as a plain causal LM on the number/date/fact
   half of the shipped alpaca sample plus the sst2-sample training sentences (no labels), then
   exported (``zfctl export``). ``--model smollm2-135m`` skips this (it is pretrained already).
2. Fine-tuning tasks the base has not seen, built from the shipped samples into ``<cache>/data``:
   ``instruct``: the word/string half of the alpaca sample (reversal, sorting words, case,
   letters, counting words), instruction template, loss on the response; ``text``: the same
   unseen records as plain text (causal LM on every token); ``sst2``: sst2-sample
   classification (the label word after a prompt the base never saw), scored by accuracy too
   (the label word with the higher log-likelihood) on all 100 validation sentences (1 point = 1
   sentence). It runs ``--sst2-steps`` (default 3 x ``--steps``): its sequences are short, and in
   80 steps AdamW itself does not learn the task (55%, near a constant answer), so 80 steps could
   not tell a good optimizer from a bad one; in 240 it reaches 84%.

   The fine-tuning lr is 1e-4 (cosine, 5 warm-up steps): the base's weights have a std of ~0.03,
   so an Adam step moves them ~0.3% per step, already more than a usual LLM fine-tune (smollm2 at
   5e-5: ~0.1%). At 1e-3 (~3% per step, the pre-training regime) every optimizer's staleness
   dominates the result; ``--lr 1e-3`` still measures that regime (docs/accuracy.md).
   sst2 runs at ``--sst2-lr`` 3e-4, the lowest of 1e-4/3e-4/1e-3 at which AdamW learns it in 240
   steps (58% / 71% / 84%).
3. Per task and variant, mean over the seeds: eval loss at fixed steps (the loop's own evaluation, from
   ``metrics.jsonl``; the last one after the final CPU update is installed), the final gap to the
   first variant in %, the mean step time, and for ``sst2`` the validation accuracy of the final
   weights (the checkpoint with its in-flight CPU update installed, as ``zfctl export`` does), with
   its min-max over the seeds, and a second table of sst2 accuracy per seed.

Variants are ``LABEL=PRESET[+KEY=VALUE...]``: a zenflow preset plus ``--set``-style overrides. The
first variant is the reference for the gap column. Runs live under ``<cache>/runs`` (replaced on
every call); the cache folder (default ``.zfctl-cache/accuracy``) is git-ignored.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import re
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch
import transformers

from zfctl.plan import resolve_plan
from zfctl.resources import presets_root
from zfctl.train.data.templates import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, CLASSIFICATION_PROMPT

DEFAULT_VARIANTS = ["adamw=off", "paper=paper", "default=default"]
TASKS = ("instruct", "text", "sst2")
# The fine-tuning half of the alpaca sample: word and string manipulation. The rest (arithmetic,
# comparisons, dates, fictional facts) is the base's pre-training corpus.
_WORD_TASKS = re.compile(r"^(Reverse the|Sort the words|Convert the text|Convert snake_case|Convert the words"
                         r"|What is the (first|last) letter|How many (letters|words|times does the letter))")
BASE = {  # tiny-llama pre-training: enough to learn the embedded tokenizer's English and the formats
    "steps": 200, "lr": 3e-3, "micro_batch_size": 16, "max_length": 96, "warmup_steps": 20,
}


@dataclass
class Result:
    task: str
    variant: str
    evals: dict[int, float]  # step -> eval loss
    ms_per_step: float
    wall_s: float
    accuracy: float | None = None
    seed: int = 0  # the fine-tuning seed (the base's is --seed)
    notes: list[str] = field(default_factory=list)

    @property
    def final(self) -> float:
        return self.evals[max(self.evals)]


# -- data ------------------------------------------------------------------------------------------
def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write(path: Path, rows: list[dict]) -> Path:
    """Write ``rows`` as JSONL unless the file already holds them; atomically (harnesses may share a cache)."""
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def _as_text(rec: dict) -> str:
    """An alpaca record as the plain text the instruction template would show, answer included."""
    fmt = ALPACA_PROMPT if rec.get("input", "").strip() else ALPACA_PROMPT_NO_INPUT
    return fmt.format(instruction=rec["instruction"], input=rec.get("input", "")) + rec["output"]


def build_data(cache: Path) -> dict[str, Path]:
    """The base corpus and the task files, derived from the shipped samples (deterministic)."""
    samples = presets_root() / "samples"
    out: dict[str, Path] = {}
    for split in ("train", "validation"):
        alpaca = _records(samples / "alpaca-sample" / f"{split}.jsonl")
        sst2 = _records(samples / "sst2-sample" / f"{split}.jsonl")
        words = [r for r in alpaca if _WORD_TASKS.match(r["instruction"])]
        rest = [r for r in alpaca if not _WORD_TASKS.match(r["instruction"])]
        base = [{"text": _as_text(r)} for r in rest] + [{"text": r["sentence"]} for r in sst2]
        out[f"base-{split}"] = _write(cache / "data" / f"base-{split}.jsonl", base)
        out[f"instruct-{split}"] = _write(cache / "data" / f"instruct-{split}.jsonl", words)
        out[f"text-{split}"] = _write(cache / "data" / f"text-{split}.jsonl", [{"text": _as_text(r)} for r in words])
    return out


def task_data(task: str, files: dict[str, Path]) -> tuple[str, list[str]]:
    """(--data argument, --set overrides) for one task."""
    if task == "sst2":
        return "sst2-sample", ["data.max_length=64"]
    template = "alpaca" if task == "instruct" else "text"
    return str(files[f"{task}-train"]), [f"data.template={template}",
                                         f"data.validation_split={files[f'{task}-validation']}", "data.max_length=64"]


# -- runs ------------------------------------------------------------------------------------------
def _train(model: str, data: str, preset: str, overrides: list[str], out: Path, log: Path):
    """One `zfctl finetune`, in this process, its console output into ``log``."""
    from zfctl.train import run

    plan = resolve_plan(model, data, zenflow=preset, overrides=[*overrides, f"checkpoint.output_dir={out}"])
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        return run(plan, force=True)


def ensure_base(cache: Path, files: dict[str, Path], seed: int) -> Path:
    """The pre-trained tiny-llama folder, trained and exported on the first call only."""
    from zfctl.train import export

    key = hashlib.sha256(json.dumps({**BASE, "seed": seed, "data": files["base-train"].read_text()},
                                    sort_keys=True).encode()).hexdigest()[:10]
    folder = cache / f"base-tiny-llama-{key}"
    if (folder / "config.json").is_file():
        return folder
    print(f"pre-training the base once ({BASE['steps']} AdamW steps; cached in {folder}) ...", flush=True)
    t0 = time.perf_counter()
    run_dir = cache / "runs" / "base"
    overrides = ["data.template=text", f"data.validation_split={files['base-validation']}",
                 f"data.max_length={BASE['max_length']}", f"train.max_steps={BASE['steps']}",
                 f"train.lr={BASE['lr']}", f"train.micro_batch_size={BASE['micro_batch_size']}",
                 f"train.warmup_steps={BASE['warmup_steps']}", f"train.seed={seed}", "train.eval_every=0",
                 "checkpoint.every=0", "checkpoint.keep_last=1", "logging.every=50", "train.device=cpu"]
    result = _train("tiny-llama", str(files["base-train"]), "off", overrides, run_dir, run_dir.parent / "base.log")
    export(result.output_dir, folder, force=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"base: eval loss {result.final_eval_loss:.4f} after {time.perf_counter() - t0:.0f} s", flush=True)
    return folder


def finetune(model: str, task: str, label: str, spec: str, files: dict[str, Path], args, seed: int) -> Result:
    """Fine-tune ``model`` on ``task`` under variant ``spec`` with fine-tuning seed ``seed``."""
    preset, *sets = spec.split("+")
    data, data_sets = task_data(task, files)
    out = args.cache / "runs" / task / f"{label}-s{seed}"
    steps = args.sst2_steps if task == "sst2" else args.steps
    every = args.eval_every * steps // args.steps  # the same number of evaluations per task
    lr = args.sst2_lr if task == "sst2" else args.lr
    overrides = [*data_sets, f"train.max_steps={steps}", f"train.lr={lr}",
                 f"train.micro_batch_size={args.batch}", f"train.warmup_steps={args.warmup}",
                 "train.schedule=cosine", "train.weight_decay=0.0", "train.max_grad_norm=1.0",
                 f"train.eval_every={every}", f"train.eval_batches={args.eval_batches}",
                 f"train.seed={seed}", "train.precision=fp32", f"train.device={args.device}",
                 "checkpoint.every=0", "checkpoint.keep_last=1", f"logging.every={steps}",
                 f"zenflow.cpu_threads={args.threads}", *sets]
    t0 = time.perf_counter()
    result = _train(model, data, preset, overrides, out, out.parent / f"{label}-s{seed}.log")
    wall = time.perf_counter() - t0
    evals, step_ms = {}, []
    for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "eval":
            evals[int(rec["step"])] = float(rec["eval_loss"])
        elif rec.get("kind") == "train" and rec["step"] > 2:  # the first steps include warm-up effects
            step_ms.append(float(rec["step_ms"]))
    res = Result(task, label, evals, sum(step_ms) / max(1, len(step_ms)), wall, seed=seed)
    if task == "sst2":
        res.accuracy = sst2_accuracy(result.output_dir, out / "final")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    shutil.rmtree(out / "final", ignore_errors=True)
    return res


@torch.no_grad()
def sst2_accuracy(run_dir: Path, export_dir: Path) -> float:
    """Accuracy on sst2-sample's validation split: the label word with the higher log-likelihood."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zfctl.train import export
    from zfctl.train.data.templates import Rendered, tokenize

    export(run_dir, export_dir, force=True)  # the final weights: in-flight CPU update installed
    model = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    tok = AutoTokenizer.from_pretrained(export_dir)
    rows = _records(presets_root() / "samples" / "sst2-sample" / "validation.jsonl")
    scores = []
    for word in ("negative", "positive"):
        rendered = [Rendered(i, CLASSIFICATION_PROMPT.format(text=r["sentence"]), word, "label")
                    for i, r in enumerate(rows)]
        seqs = list(tokenize(rendered, tok, "sst2"))
        scores.append(torch.tensor([_loglik(model, ids, labels) for ids, labels in seqs]))
    pred = (scores[1] > scores[0]).long()
    gold = torch.tensor([int(r["label"]) for r in rows])
    return float((pred == gold).float().mean())


def _loglik(model, ids: list[int], labels: list[int]) -> float:
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)
    y = torch.tensor(labels[1:])
    keep = y != -100
    return float(logp[keep].gather(1, y[keep, None]).sum())


def _seeds(p: argparse.ArgumentParser, flag: str, value: str) -> list[int]:
    try:
        seeds = [int(s) for s in value.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        p.error(f"{flag} {value!r}: use distinct integers separated by commas, e.g. {flag} 1,2,3")
    return seeds


# -- report ----------------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def table(results: list[Result], ref_label: str) -> str:
    """Markdown: one row per task x variant, means over the fine-tuning seeds; eval loss at each step,
    gap of the final to the reference, and for sst2 the accuracy (mean, and min-max over seeds)."""
    lines = []
    for task in dict.fromkeys(r.task for r in results):
        variants = dict.fromkeys(r.variant for r in results if r.task == task)
        runs = {v: [r for r in results if r.task == task and r.variant == v] for v in variants}
        steps = sorted(set().union(*(r.evals for r in results if r.task == task)))
        nseeds = len(runs[next(iter(variants))])
        ref = _mean([r.final for r in runs.get(ref_label) or next(iter(runs.values()))])
        head = ["task", "variant", *(f"@{s}" for s in steps), "gap", "ms/step"]
        if task == "sst2":
            head += ["acc"] + (["min-max"] if nseeds > 1 else [])
        lines += [f"{task}: mean of {nseeds} seed(s)" if nseeds > 1 else "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        for v, rs in runs.items():
            final = _mean([r.final for r in rs])
            cells = [task, v, *(f"{_mean([r.evals[s] for r in rs]):.4f}" if all(s in r.evals for r in rs) else "-"
                                for s in steps),
                     f"{100 * (final - ref) / ref:+.1f}%", f"{_mean([r.ms_per_step for r in rs]):.0f}"]
            if task == "sst2":
                accs = [100 * r.accuracy for r in rs if r.accuracy is not None]
                cells.append(f"{_mean(accs):.1f}%" if accs else "-")
                if nseeds > 1:
                    cells.append(f"{min(accs):.0f}-{max(accs):.0f}" if accs else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(line for i, line in enumerate(lines) if line or i)


def seed_table(results: list[Result]) -> str:
    """Markdown: sst2 accuracy per fine-tuning seed and variant (the noise the mean averages out)."""
    rows = [r for r in results if r.task == "sst2" and r.accuracy is not None]
    seeds = sorted({r.seed for r in rows})
    if len(seeds) < 2:
        return ""
    lines = ["| sst2 acc | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | spread |",
             "|" + "---|" * (len(seeds) + 3)]
    for v in dict.fromkeys(r.variant for r in rows):
        acc = {r.seed: 100 * r.accuracy for r in rows if r.variant == v}
        vals = list(acc.values())
        sd = math.sqrt(sum((a - _mean(vals)) ** 2 for a in vals) / max(1, len(vals) - 1))
        lines.append(f"| {v} | " + " | ".join(f"{acc[s]:.0f}%" if s in acc else "-" for s in seeds)
                     + f" | {_mean(vals):.1f}% | sd {sd:.1f} |")
    return "\n".join(lines) + "\n"


def _worker_init(threads: int) -> None:
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama",
                   help="tiny-llama (pre-trained here once, cached) or a pretrained preset/folder, e.g. smollm2-135m")
    p.add_argument("--variant", action="append", default=None, metavar="LABEL=PRESET[+KEY=VALUE...]",
                   help=f"repeatable; default: {' '.join(DEFAULT_VARIANTS)}; the first is the gap's reference")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--steps", type=int, default=80, help="fine-tuning steps per run (instruct, text)")
    p.add_argument("--sst2-steps", type=int, default=None,
                   help="fine-tuning steps of the sst2 runs (default 3 x --steps: short sequences, and AdamW "
                        "needs them to learn the task)")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4,
                   help="instruct/text peak lr (tiny base: ~0.3%% of its weights' std per step); 5e-5 suits smollm2")
    p.add_argument("--sst2-lr", type=float, default=3e-4,
                   help="the sst2 runs' lr (the lowest at which AdamW learns the task in 240 steps)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size (one micro-batch per step)")
    p.add_argument("--warmup", type=int, default=5, help="LR warm-up steps")
    p.add_argument("--seed", type=int, default=42, help="the base's pre-training seed (the cached base)")
    p.add_argument("--seeds", default="42,1,2",
                   help="comma-separated fine-tuning seeds of instruct/text (the base keeps --seed); the table "
                        "shows their mean")
    p.add_argument("--sst2-seeds", default="42,1,2,3,4",
                   help="fine-tuning seeds of sst2: one seed moves its accuracy by up to 10 points "
                        "(docs/accuracy.md), so the table shows the mean and min-max over five")
    p.add_argument("--threads", type=int, default=1, help="torch and CPU-Adam threads (shared machines: 1)")
    p.add_argument("--jobs", type=int, default=2,
                   help="runs at a time, one process each (x --threads cores; step times then share the CPU)")
    p.add_argument("--device", default="cpu", choices=["cpu", "auto", "cuda"])
    p.add_argument("--cache", type=Path, default=REPO / ".zfctl-cache" / "accuracy")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    args.sst2_steps = args.sst2_steps or 3 * args.steps
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give 1 or more runs at a time")
    seeds = {t: _seeds(p, flag, value) for t, flag, value in
             (("text", "--seeds", args.seeds), ("sst2", "--sst2-seeds", args.sst2_seeds))}
    seeds["instruct"] = seeds["text"]
    variants = args.variant or DEFAULT_VARIANTS
    tasks = [t for t in args.tasks.split(",") if t]
    if bad := [t for t in tasks if t not in TASKS]:
        p.error(f"--tasks: unknown {', '.join(bad)}; use {', '.join(TASKS)}")
    parsed = []
    for v in variants:
        label, sep, spec = v.partition("=")
        if not sep or not label or not spec:
            p.error(f"--variant {v!r}: use LABEL=PRESET[+KEY=VALUE...], e.g. sel16=paper+zenflow.select_interval=16")
        parsed.append((label, spec))

    transformers.utils.logging.disable_progress_bar()  # one line per run is enough
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    t0 = time.perf_counter()
    files = build_data(args.cache)
    model = str(ensure_base(args.cache, files, args.seed)) if args.model == "tiny-llama" else args.model
    # every variant gets the same seeds: no variant is luckier
    jobs = [(model, task, label, spec, files, args, seed)
            for task in tasks for label, spec in parsed for seed in seeds[task]]
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        if args.jobs > 1:  # one process per run (each run is independent: its own folder, seed, threads)
            pool = stack.enter_context(ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                                           initializer=_worker_init, initargs=(args.threads,)))
            pending = [pool.submit(finetune, *job) for job in jobs]
            done = (f.result() for f in pending)
        else:
            done = (finetune(*job) for job in jobs)
        for r in done:
            results.append(r)
            acc = f"  acc {100 * r.accuracy:.1f}%" if r.accuracy is not None else ""
            print(f"{r.task:8s} {r.variant:16s} seed {r.seed:<4d} final eval loss {r.final:.4f}{acc}"
                  f"  ({r.wall_s:.0f} s)", flush=True)
    print()
    print(table(results, parsed[0][0]))
    print(seed_table(results))
    total = time.perf_counter() - t0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(f"harness wall time {total:.0f} s (load average at the end {load:.2f}); model {model}")
    if args.json:
        args.json.write_text(json.dumps({"model": model, "args": {k: str(v) for k, v in vars(args).items()},
                                         "wall_s": total, "results": [r.__dict__ for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
