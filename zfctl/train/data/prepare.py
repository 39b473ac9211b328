"""The data pipeline: records -> templated, tokenised, truncated/packed sequences, cached.

``prepare_data`` is called once, before any process group forms (torchrun ranks then find the
cache entry and memory-map it). Its result holds the train and eval sequences as
`datasets.Dataset`s with ``input_ids`` and ``labels`` columns (labels are -100 where no loss is
taken; packed blocks add ``position_ids``, restarting at each sequence) and a ``collate`` that
right-pads a micro-batch.

    source (.source) -> slice [start_idx, end_idx) -> hold out eval -> template + tokenise
    (.templates; .chat for template chat) -> truncate to max_length -> pack into max_length
    blocks (data.packing) -> cache (.cache)
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from zfctl.errors import ConfigError
from zfctl.plan.schema import DataConfig
from zfctl.train.data import cache as data_cache
from zfctl.train.data import chat
from zfctl.train.data import source as data_source
from zfctl.train.data.templates import IGNORE_INDEX, TEMPLATE_VERSION, pack, render, tokenize, truncate


@dataclass
class DataStats:
    """What preparation produced; printed at run start and by --debug-data."""

    records: int  # records used from the train split (after slicing, before holding out)
    train: int  # train sequences
    eval: int  # eval sequences
    dropped: int  # sequences dropped because no trained token fit in max_length (the prompt filled it)
    train_tokens: int
    loss_tokens: int  # train tokens that carry a label (the rest are prompt / -100)
    packed: int = 0  # sequences packed into the train blocks (data.packing); 0 when not packing
    from_cache: bool = False


@dataclass
class PreparedData:
    """Tokenised train/eval sequences and the collate function that batches them."""

    train: Any  # datasets.Dataset: {"input_ids": list[int], "labels": list[int]} rows
    eval: Any | None  # same, or None when nothing is held out
    pad_id: int
    stats: DataStats
    name: str = ""
    max_length: int = 0
    cache_path: Path | None = None
    cache_warning: str | None = None  # why the cache could not be written (the run goes on without it)

    @functools.cached_property
    def train_digest(self) -> str:
        """A digest of the training sequences: saved in each checkpoint, so that a resume on data
        that changed with its record count (an edited answer, another tokenizer) is refused
        instead of continuing on other tokens. Computed once per run (:func:`sequences_digest`)."""
        return sequences_digest(self.train)

    def collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        """Right-pad to the longest sequence of the micro-batch (pad labels -100, mask 0).

        Padding to the batch's longest, not to max_length, keeps short-sample batches cheap.
        Packed blocks also carry ``position_ids``; the padding gets positions from 0 again, a
        sequence of its own that no real token attends to.
        """
        width = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        packed = "position_ids" in examples[0]
        positions = torch.zeros((len(examples), width), dtype=torch.long)
        for row, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[row, :n] = torch.as_tensor(e["input_ids"], dtype=torch.long)
            labels[row, :n] = torch.as_tensor(e["labels"], dtype=torch.long)
            mask[row, :n] = 1
            if packed:
                positions[row, :n] = torch.as_tensor(e["position_ids"], dtype=torch.long)
                positions[row, n:] = torch.arange(width - n)
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        return {**batch, "position_ids": positions} if packed else batch

    def summary(self) -> str:
        """One line: sizes, tokens, share of tokens in the loss, cache state."""
        s = self.stats
        share = s.loss_tokens / max(1, s.train_tokens)
        dropped = f", {s.dropped} dropped (no trained token within max_length)" if s.dropped else ""
        cached = " (from cache)" if s.from_cache else ""
        kind = f"blocks ({s.packed} sequences packed)" if s.packed else "sequences"
        return (
            f"{self.name}: {s.train} train / {s.eval} eval {kind} from {s.records} records, "
            f"{s.train_tokens:,} train tokens ({share:.0%} in the loss){dropped}{cached}"
        )


def sequences_digest(ds) -> str:
    """xxh3-128 of a split's content: per column, its sequence lengths and its ids, in row order.

    The same sequences give the same digest however Arrow chunked them (freshly built, or
    memory-mapped from the cache). One read of the split: ~0.1 s per 100 M tokens from memory.
    """
    import numpy as np
    import xxhash

    table = ds.with_format("arrow")[:]  # a zero-copy view of every row, in order
    whole = xxhash.xxh3_128()
    for name in sorted(table.column_names):
        lengths, values = xxhash.xxh3_128(), xxhash.xxh3_128()
        for chunk in table.column(name).chunks:  # Arrow buffers are little-endian on every machine
            lengths.update(np.ascontiguousarray(chunk.value_lengths().to_numpy(zero_copy_only=False)).data)
            values.update(np.ascontiguousarray(chunk.flatten().to_numpy(zero_copy_only=False)).data)
        whole.update(f"{name}:{table.schema.field(name).type}:{lengths.hexdigest()}:{values.hexdigest()};".encode())
    return whole.hexdigest()


def prepare_data(cfg: DataConfig, tokenizer, *, seed: int, cache_dir: Path | None = None) -> PreparedData:
    """Load, template, tokenise and cache `cfg`'s data (see the module docstring).

    A hit in the cache (same config, tokenizer, source files and seed) returns at once without
    reading the source. Raises UserError/ConfigError for every user mistake.
    """
    if cfg.max_length < 2:
        raise ConfigError("data.max_length", cfg.max_length, "must be at least 2 tokens")
    source = data_source.resolve(cfg)
    cache_dir = Path(cache_dir) if cache_dir is not None else data_cache.cache_root() / "data"
    raw_train = None
    fingerprint = source.file_fingerprint()
    if fingerprint is None:  # hub: the dataset's fingerprint is known once it is loaded
        raw_train = source.read("train")
        fingerprint = raw_train.fingerprint
    key = data_cache.cache_key(
        cfg,
        data_cache.tokenizer_fingerprint(tokenizer),
        fingerprint,
        seed=seed,
        template_version=TEMPLATE_VERSION,
        chat_template=chat.chat_template(tokenizer) if cfg.template == "chat" else None,
    )
    path = data_cache.entry_dir(cache_dir, cfg.path or cfg.name, key)
    hit = data_cache.load(path)
    if hit is None:
        dsd, stats = _build(cfg, tokenizer, source, raw_train, seed)
        try:
            data_cache.save(dsd, asdict(stats), path)
        except OSError as e:  # read-only or full disk: train from memory; load_inputs says so once
            from zfctl.writable import os_error_line

            result = _result(cfg, tokenizer, dsd, stats, None)
            result.cache_warning = (f"the data cache was not written ({os_error_line(e)}): the data was "
                                    "tokenised in memory and will be again next run; set ZFCTL_CACHE_DIR "
                                    "to a writable folder to keep it")
            return result
        hit = data_cache.load(path)  # memory-mapped from the cache from now on
        if hit is None:
            return _result(cfg, tokenizer, dsd, stats, None)
        return _result(cfg, tokenizer, hit[0], stats, path)
    dsd, meta = hit
    return _result(cfg, tokenizer, dsd, DataStats(**{**meta, "from_cache": True}), path)


def _result(cfg: DataConfig, tokenizer, dsd, stats: DataStats, path: Path | None) -> PreparedData:
    pad = tokenizer.pad_token_id
    if pad is None:  # e.g. Llama/GPT-2: any id works, padded positions are masked and unlabelled
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ev = dsd["eval"] if "eval" in dsd and len(dsd["eval"]) else None
    return PreparedData(
        dsd["train"], ev, pad, stats, name=cfg.name, max_length=cfg.max_length, cache_path=path
    )


def _build(cfg: DataConfig, tokenizer, source, raw_train, seed: int):
    """Read, slice, split, tokenise; returns (DatasetDict(train, eval), DataStats)."""
    import datasets

    raw = raw_train or source.read("train")
    start, end = _slice(cfg, len(raw.records), raw.where)
    indices = list(range(start, end))
    if source.eval is not None:
        raw_eval = source.read("eval")
        eval_part = (raw_eval, list(range(len(raw_eval.records))))
        train_idx = indices
    else:
        train_idx, eval_idx = _hold_out(indices, cfg.validation_fraction, seed)
        eval_part = (raw, eval_idx)
    dropped = [0]
    train = _sequences(cfg, tokenizer, raw, train_idx, dropped)
    evals = _sequences(cfg, tokenizer, *eval_part, dropped)
    if not train:
        raise ConfigError(
            "data.max_length",
            cfg.max_length,
            f"{raw.where}: no training sequence is left: no trained token fits in max_length "
            "(every prompt is longer); raise it",
        )
    columns = ["input_ids", "labels", "position_ids"] if cfg.packing else ["input_ids", "labels"]
    features = datasets.Features({c: datasets.Sequence(datasets.Value("int32")) for c in columns})

    def table(seqs):
        return datasets.Dataset.from_dict(
            {c: [s[k] for s in seqs] for k, c in enumerate(columns)}, features=features
        )

    stats = DataStats(
        records=len(indices),
        train=len(train),
        eval=len(evals),
        dropped=dropped[0],
        train_tokens=sum(len(s[0]) for s in train),
        loss_tokens=sum(sum(1 for x in s[1] if x != IGNORE_INDEX) for s in train),
        packed=sum(p.count(0) for _, _, p in train) if cfg.packing else 0,
    )
    # An empty split is left out: datasets cannot reload a saved zero-row table.
    splits = {"train": table(train), **({"eval": table(evals)} if evals else {})}
    return datasets.DatasetDict(splits), stats


def _slice(cfg: DataConfig, n: int, where: str) -> tuple[int, int]:
    """[start_idx, end_idx) checked against the split's length (end_idx past the end is clipped)."""
    start = cfg.start_idx
    if start < 0 or start >= n:
        raise ConfigError("data.start_idx", start, f"{where} has {n} records; use 0..{n - 1}")
    end = n if cfg.end_idx is None else min(cfg.end_idx, n)
    if end <= start:
        raise ConfigError("data.end_idx", cfg.end_idx, f"must be greater than data.start_idx={start}")
    return start, end


def _hold_out(indices: list[int], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded split of `indices` into (train, eval); eval gets round(fraction*n), at least 1 if fraction>0."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError("data.validation_fraction", fraction, "must be in [0, 1)")
    n_eval = 0 if fraction == 0 else max(1, round(fraction * len(indices)))
    if n_eval >= len(indices):
        raise ConfigError(
            "data.validation_fraction",
            fraction,
            f"leaves no training record out of {len(indices)}; lower it or use more records",
        )
    shuffled = indices[:]
    random.Random(seed).shuffle(shuffled)  # own RNG: the global stream is not touched
    return sorted(shuffled[n_eval:]), sorted(shuffled[:n_eval])


def _sequences(cfg: DataConfig, tokenizer, raw, idx: list[int], dropped: list[int]) -> list:
    """Template + tokenise the records `idx` of `raw`, then truncate and/or pack."""
    if cfg.template == "chat":
        convs = (chat.normalize(raw.records[i], raw.where, i) for i in idx)
        seqs = chat.sequences(convs, tokenizer, cfg.max_length, raw.where, dropped)
        return list(pack(seqs, cfg.max_length, split=False)) if cfg.packing else list(seqs)
    rendered = (render(raw.records[i], cfg, raw.where, i) for i in idx)
    seqs = tokenize(rendered, tokenizer, raw.where)
    if cfg.packing:  # plain text: every token kept, a long document continues in the next block
        return list(pack(seqs, cfg.max_length, split=True))
    return list(truncate(seqs, cfg.max_length, dropped))


def format_debug_samples(prepared: PreparedData, tokenizer, n: int = 3) -> str:
    """Decoded train samples with their label masks, for ``--debug-data``.

    Text inside ⟦ ⟧ carries labels (is in the loss); everything else is masked with -100. A
    chat sample shows its conversation with the assistant's turns marked; a packed block says
    where each of its sequences starts. The data's summary is not repeated here: load_inputs
    (zfctl/train/inputs.py) has printed it as the ``data:`` line just before.
    """
    lines = ["text inside ⟦ ⟧ is in the loss; the rest is masked with -100"]
    for i in range(min(n, len(prepared.train))):
        ex = prepared.train[i]
        ids, in_loss = ex["input_ids"], [x != IGNORE_INDEX for x in ex["labels"]]
        packed = ""
        if "position_ids" in ex:
            starts = [j for j, p in enumerate(ex["position_ids"]) if p == 0]
            packed = f"; {len(starts)} sequences packed, starting at tokens {', '.join(map(str, starts))}"
        bounds = [0] + [j for j in range(1, len(ids)) if in_loss[j] != in_loss[j - 1]] + [len(ids)]
        text, mask = [], []
        for a, b in itertools.pairwise(bounds):
            piece = tokenizer.decode(ids[a:b], skip_special_tokens=False)
            text.append(f"⟦{piece}⟧" if in_loss[a] else piece)
            mask.append(f"{b - a}×{'loss' if in_loss[a] else '-100'}")
        lines.append(
            f"--- train[{i}]: {len(ids)} tokens, {sum(in_loss)} in the loss (labels: {', '.join(mask)}){packed}"
        )
        lines.append("".join(text))
    return "\n".join(lines)
