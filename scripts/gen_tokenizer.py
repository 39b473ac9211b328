"""Train the embedded tokenizer (presets/tokenizers/embedded) for the `tiny-llama` preset.

A byte-level BPE (the `tokenizers` library) trained on the two shipped samples, with exactly
4096 tokens: 4 special tokens (`<pad>`=0, `<s>`=1, `</s>`=2, `<unk>`=3), the 256 byte symbols,
and 3836 merges. Digits are split one per token before BPE, so numbers are spelled digit by digit;
a tiny model learns arithmetic from digits far faster than from thousands of number tokens.
It is saved as a transformers `PreTrainedTokenizerFast` folder, so
`AutoTokenizer.from_pretrained(folder)` loads it and `zfctl export` can copy it. Like Llama's, it
prepends `<s>` when asked to add special tokens.

Run after the sample generators (it reads their output). Deterministic: same inputs, same bytes.

    python scripts/gen_tokenizer.py [--samples presets/samples] [--out presets/tokenizers/embedded]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 4096
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
ROOT = Path(__file__).resolve().parent.parent / "presets"
# The section markers zfctl's prompt templates use, so that each is a few tokens, not a dozen.
MARKERS = ["### Instruction:\n", "### Input:\n", "### Response:\n", "### Text:\n", "### Label:\n"]


def corpus(samples: Path) -> list[str]:
    """Every text field of every shipped sample record, in file order (determinism)."""
    texts: list[str] = []
    for folder in sorted(p for p in samples.iterdir() if p.is_dir()):
        for split in ("train.jsonl", "validation.jsonl"):
            for line in (folder / split).read_text(encoding="utf-8").splitlines():
                texts.extend(v for v in json.loads(line).values() if isinstance(v, str) and v)
    # Case variants of every word: the samples convert case (title, upper, camelCase), and a
    # user's data capitalises differently; they also give BPE enough distinct pairs to reach
    # exactly 4096 tokens on this small corpus. Sorted for a deterministic order.
    words = sorted({w.strip(".,;:?!'\"()") for t in texts for w in t.split()} - {""})
    variants = [" ".join(f(w) for w in words) for f in (str.lower, str.capitalize, str.upper)]
    return texts + variants + MARKERS * 200 + ["positive", "negative"] * 200


def train(texts: list[str]) -> Tokenizer:
    """Byte-level BPE with exactly VOCAB_SIZE tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:  # the corpus ran out of pairs to merge
        raise SystemExit(f"BPE reached only {tok.get_vocab_size()} tokens; add text to the corpus")
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def save(tok: Tokenizer, out: Path) -> None:
    """Write a PreTrainedTokenizerFast folder (tokenizer.json + tokenizer_config.json + specials)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", model_max_length=1024, padding_side="right",
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # transformers 5 writes its own class name ("TokenizersBackend"), which 4.x cannot resolve;
    # "PreTrainedTokenizerFast" means the same tokenizer.json-backed class in both majors.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=Path, default=ROOT / "samples")
    ap.add_argument("--out", type=Path, default=ROOT / "tokenizers" / "embedded")
    args = ap.parse_args(argv)
    tok = train(corpus(args.samples))
    save(tok, args.out)
    print(f"wrote a {tok.get_vocab_size()}-token byte-level BPE to {args.out}")


if __name__ == "__main__":
    main()
