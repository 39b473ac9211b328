"""The prompt format a run trained on, as a Jinja chat template.

``zfctl export`` saves it as the exported tokenizer's ``chat_template``, and ``zfctl generate``
renders its prompt with it, so ``tokenizer.apply_chat_template`` on an export builds the very
prompt the model saw in training: ``<s>`` + the template's prompt text, ending where the trained
response starts. For template ``chat`` it is the template the run rendered with
(zfctl/train/data/chat.py); for the others it is written here from the same prompt strings
zfctl/train/data/templates.py trains with. A user message is the template's main field (alpaca's
``instruction``, classification's text, the ``prompt`` of prompt_completion), an assistant message
the response followed by EOS. A ``system`` message has no place in these formats and is left out.
Training tokenises ``[BOS] + prompt + response + [EOS]`` in pieces; the rendered text tokenises to
the same ids (tests/train/test_prompt_format.py checks it on every shipped template).
"""

from __future__ import annotations

from zfctl.plan.schema import DataConfig
from zfctl.train.data.templates import ALPACA_PROMPT_NO_INPUT, CLASSIFICATION_PROMPT

# The prompt strings with the user's text spliced in as a Jinja expression. Each format's
# placeholder is the single field of the prompt ({instruction}, {text}).
_PLACEHOLDER = "\x00"


def _jinja_literal(text: str) -> str:
    """``text`` as a Jinja string literal (single quotes, newlines escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _exchange_template(prompt: str) -> str:
    """A chat template for one prompt string with one placeholder: each user turn is rendered as
    ``bos + prompt(content)``, each assistant turn as ``content + eos``; the generation prompt is
    empty (the prompt already ends where the response starts)."""
    before, after = prompt.split(_PLACEHOLDER)
    return (
        "{#- zfctl: the prompt format this run trained on (zfctl/train/data/prompt_format.py) -#}\n"
        "{%- for message in messages -%}\n"
        "    {%- if message['role'] == 'user' -%}\n"
        f"        {{{{- bos_token + {_jinja_literal(before)} + message['content'] + {_jinja_literal(after)} -}}}}\n"
        "    {%- elif message['role'] == 'assistant' -%}\n"
        "        {%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}\n"
        "    {%- endif -%}\n"
        "{%- endfor -%}\n"
    )


def prompt_template(cfg: DataConfig, tokenizer) -> str:
    """The Jinja chat template that renders ``cfg.template``'s prompt for ``tokenizer``."""
    if cfg.template == "chat":
        from zfctl.train.data.chat import chat_template

        return chat_template(tokenizer)
    if cfg.template == "alpaca":
        return _exchange_template(ALPACA_PROMPT_NO_INPUT.format(instruction=_PLACEHOLDER))
    if cfg.template == "classification":
        return _exchange_template(CLASSIFICATION_PROMPT.format(text=_PLACEHOLDER))
    # prompt_completion renders the prompt as written; text has no prompt: the user's text is
    # the start of a document the model continues.
    return _exchange_template(_PLACEHOLDER)
