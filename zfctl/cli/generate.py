"""`zfctl generate RUN_OR_EXPORT --prompt TEXT` (or `--chat`): try the fine-tuned model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from zfctl.cli._common import VerboseOpt, console, note_line
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
    chat: Annotated[
        bool,
        typer.Option("--chat", help="Ask one prompt after another at the terminal (Ctrl-D ends); a chat run "
                     "keeps the conversation."),
    ] = False,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="Stop after this many new tokens (or at EOS).")
    ] = 128,
    temperature: Annotated[
        float, typer.Option("--temperature", min=0.0, help="0 = greedy (the most likely token each time).")
    ] = 0.0,
    verbose: VerboseOpt = False,
) -> None:
    """Generate from a fine-tuned model in the prompt format its run trained on (streamed)."""
    if (prompt is None) == (not chat):
        raise UserError("give --prompt TEXT, or --chat for an interactive session (not both)")
    if chat and not sys.stdin.isatty():
        raise UserError("--chat needs a terminal on stdin; for piped or scripted input use --prompt TEXT")
    if prompt is not None and not prompt.strip():
        raise UserError("--prompt is empty; give the text to answer")
    from zfctl.quiet import set_verbose

    set_verbose(verbose)  # before transformers loads: its "Loading weights" bar reads the environment once
    import torch

    from zfctl.train.generate import load_generator, read_turns

    notes: list[str] = []
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = load_generator(source, device, notes)
    for line in notes:
        note_line(line)
    console.print(f"model: {gen.source}", style="dim", highlight=False, soft_wrap=True)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    turns = [prompt] if prompt is not None else read_turns(input)
    for text in turns:
        answer = gen.reply(text, max_new_tokens=max_new_tokens, temperature=temperature, on_text=stream)
        stream("\n")
        if not answer.strip():
            note_line("the answer is empty or blank: the model has not learnt to answer this prompt "
                      "(yet)")
