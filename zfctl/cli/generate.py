"""`zfctl generate RUN_OR_EXPORT --prompt TEXT` (or `--prompts FILE`, or `--chat`): try the fine-tuned model."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from zfctl.cli._common import VerboseOpt, console, err_console, note_line
from zfctl.errors import UserError


def generate(
    source: Annotated[
        Path,
        typer.Argument(exists=True, metavar="RUN_OR_EXPORT",
                       help="A run folder (its newest checkpoint), a checkpoint folder, or a zfctl export folder."),
    ],
    prompt: Annotated[
        str | None,
        typer.Option("--prompt", "-p", help="The text to answer, rendered in the run's prompt format "
                     "(alpaca's instruction, a chat's user turn)."),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option("--prompts", metavar="FILE",
                     help="Answer every prompt of FILE: one per line as typed (plain text; control characters "
                     'refused), or JSON: a .jsonl file holds one per line, each a string or {"prompt": ..., '
                     '"system": ...}; a .json file an array of them (or JSON lines). Writes one JSON line per '
                     'prompt to stdout: {"prompt", "answer"} (and "system").'),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option("--chat", help="Ask one prompt after another at the terminal (Ctrl-D ends); a chat run "
                     "keeps the conversation."),
    ] = False,
    system: Annotated[
        str | None,
        typer.Option("--system", metavar="TEXT", help="A chat run's system turn before each conversation (runs "
                     "trained with template chat only)."),
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="Stop after this many new tokens (or at EOS).")
    ] = 128,
    temperature: Annotated[
        float, typer.Option("--temperature", min=0.0, help="0 = greedy (the most likely token each time).")
    ] = 0.0,
    verbose: VerboseOpt = False,
) -> None:
    """Generate from a fine-tuned model in the prompt format its run trained on (streamed)."""
    if sum((prompt is not None, prompts is not None, chat)) != 1:
        raise UserError("give one of --prompt TEXT, --prompts FILE, or --chat for an interactive session")
    if chat and (sys.stdin is None or not sys.stdin.isatty()):  # None: fd 0 closed (`<&-`)
        where = "stdin is closed" if sys.stdin is None else "stdin is not one"
        raise UserError(f"--chat needs a terminal on stdin ({where}); for piped or scripted input use "
                        "--prompt TEXT or --prompts FILE")
    if prompt is not None and not prompt.strip():
        raise UserError("--prompt is empty; give the text to answer")
    if system is not None and not system.strip():
        raise UserError("--system is empty; give the system turn's text, or leave --system out")
    from zfctl.train.prompts import read_prompts

    batch = read_prompts(prompts) if prompts is not None else None  # every line checked before the model loads
    from zfctl.quiet import set_verbose

    set_verbose(verbose)  # before transformers loads: its "Loading weights" bar reads the environment once
    import torch

    from zfctl.train.checkpoint import use_checkpoint_with
    from zfctl.train.generate import check_system, load_generator, read_turns

    # a damaged checkpoint's line names this command on an intact one (generate has no --latest-good)
    asked = (f"--prompt {shlex.quote(prompt)}" if prompt is not None else
             f"--prompts {shlex.quote(str(prompts))}" if prompts is not None else "--chat")
    use_checkpoint_with(lambda ckpt: f"zfctl generate {shlex.quote(str(ckpt))} {asked}")
    check_system(source, system, wanted=system is not None or any(p.system for p in batch or []))
    notes: list[str] = []
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = load_generator(source, device, notes)
    for line in notes:
        note_line(line)
    if batch is not None:  # JSON lines on stdout, nothing else there: the model line goes to stderr
        err_console.print(f"model: {gen.source}", style="dim", highlight=False, soft_wrap=True)
        for p in batch:  # every prompt's length first: a refusal comes before any answer
            gen.check_length(gen.messages(p.text, p.system or system), what=f"{prompts} line {p.line}")
        for p in batch:
            answer = gen.answer(p.text, system=p.system or system, max_new_tokens=max_new_tokens,
                                temperature=temperature)
            row = {"prompt": p.text, **({"system": p.system or system} if p.system or system else {}),
                   "answer": answer}
            sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
            sys.stdout.flush()
        return
    console.print(f"model: {gen.source}", style="dim", highlight=False, soft_wrap=True)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    turns = [prompt] if prompt is not None else read_turns(input)
    for text in turns:
        answer = gen.reply(text, max_new_tokens=max_new_tokens, temperature=temperature, on_text=stream,
                           system=system)
        stream("\n")
        if not answer.strip():
            note_line("the answer is empty or blank: the model has not learnt to answer this prompt "
                      "(yet)")
