"""Where the records come from: a shipped sample, a local file or folder, or a hub dataset.

JSON, JSON-lines and CSV files are parsed here rather than by `datasets`' builders: those infer
one Arrow schema for the whole file and reject a mistyped record without saying which one,
and CSV type inference turns an all-digit answer column into ints. Parsing ourselves keeps every
value as the user wrote it, so a bad record is reported by file, index and field. Parquet is
typed already and goes through `datasets`, as do hub ids. Text files are read as ``utf-8-sig``:
a byte-order mark (what Windows editors and Excel's "CSV UTF-8" write first) is skipped, not an
error.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zfctl.errors import ConfigError, UserError
from zfctl.plan.schema import DataConfig
from zfctl.resources import presets_root
from zfctl.train.models import hub as model_hub

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
LOCAL_DATA = ("the shipped samples (alpaca-sample, sst2-sample, chat-sample) or a local "
              ".json/.jsonl/.csv/.parquet file")


@dataclass
class RawSplit:
    """The records of one split, and how to name them in an error."""

    where: str  # a file path, or "hub dataset NAME split S"
    records: Sequence  # of dicts: a list, or a datasets.Dataset (indexable, iterable)
    fingerprint: str  # changes when the records change (part of the cache key)


@dataclass
class DataSource:
    """Resolved locations of the train split and the optional named eval split."""

    kind: str  # "files" | "hub"
    train: str  # file path or hub split name
    eval: str | None  # file path, hub split name, or None = hold out a fraction of train
    repo: str | None = None  # hub id
    subset: str | None = None

    def file_fingerprint(self) -> str | None:
        """For files: the path and content digest of each (:func:`content_fingerprint`); for hub:
        None (known after load)."""
        if self.kind != "files":
            return None
        return "|".join(content_fingerprint(Path(f)) for f in filter(None, (self.train, self.eval)))

    def read(self, which: str) -> RawSplit:
        """Load the 'train' or 'eval' split."""
        target = self.train if which == "train" else self.eval
        assert target is not None, "read('eval') only when an eval split is named"
        if self.kind == "files":
            return read_file(Path(target))
        assert self.repo is not None, "a hub source always names its repo"
        return read_hub(self.repo, self.subset, target)


def content_fingerprint(path: Path) -> str:
    """``path`` and the xxh3-128 digest of its bytes: what the data cache is keyed on. The content,
    not the size and modification time: an edit that keeps both (a copy with ``cp -p``, a
    same-length fix within one second, a restored backup) must not reuse the old tokens. One
    sequential read of the file per run (xxh3 hashes far faster than a disk reads)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return f"{path.resolve()}:{h.hexdigest()}"


def resolve(cfg: DataConfig) -> DataSource:
    """Find the files (or hub split names) `cfg` points at; ConfigError naming the key if absent."""
    ref = cfg.path or cfg.name
    if cfg.source == "hub":
        return DataSource("hub", cfg.split, cfg.validation_split, repo=ref, subset=cfg.subset)
    if cfg.source == "sample":
        root = presets_root() / "samples"
        path = root / ref
        if not path.exists():
            names = ", ".join(sorted(p.name for p in root.iterdir() if p.is_dir()))
            raise ConfigError("data.path", ref, f"no shipped sample of that name; samples: {names}")
    elif cfg.source == "local":
        path = Path(ref).expanduser()
        if not path.exists():
            raise ConfigError("data.path", ref, f"no such file or folder; give {LOCAL_DATA}")
    else:
        raise ConfigError("data.source", cfg.source, "use sample, local or hub")
    if path.is_dir():
        train = _split_file(path, cfg.split, "data.split")
        val = (
            _split_file(path, cfg.validation_split, "data.validation_split") if cfg.validation_split else None
        )
        return DataSource("files", str(train), None if val is None else str(val))
    _check_suffix(path, "data.path")
    val = None
    if cfg.validation_split:  # for a single file: a second file, or a sibling named after the split
        given = Path(cfg.validation_split).expanduser()
        # A split *name* ("validation") may be a sibling file; a path ("/x/eval.jsonl") never is.
        sibling = path.with_name(given.name + path.suffix) if given.name == cfg.validation_split else None
        val = given if given.is_file() else sibling if sibling is not None and sibling.is_file() else None
        if val is None:
            raise ConfigError(
                "data.validation_split",
                cfg.validation_split,
                f"no such file{f' (nor {sibling})' if sibling is not None else ''}; give an eval file, or "
                "null to hold out data.validation_fraction of the training records",
            )
        _check_suffix(val, "data.validation_split")
    return DataSource("files", str(path), None if val is None else str(val))


def _split_file(folder: Path, split: str, key: str) -> Path:
    for suffix in SUFFIXES:
        if (folder / f"{split}{suffix}").is_file():
            return folder / f"{split}{suffix}"
    have = ", ".join(sorted(p.stem for p in folder.iterdir() if p.suffix in SUFFIXES)) or "none"
    raise ConfigError(key, split, f"{folder} has no {split}.jsonl/.json/.csv/.parquet; splits there: {have}")


def _check_suffix(path: Path, key: str) -> None:
    if path.suffix.lower() not in SUFFIXES:
        raise ConfigError(key, str(path), "unsupported file type; use .json, .jsonl, .csv or .parquet")


def read_file(path: Path) -> RawSplit:
    """Records of one local file, values exactly as written."""
    suffix = path.suffix.lower()
    fingerprint = content_fingerprint(path)
    try:
        if suffix == ".jsonl":
            records = _read_jsonl(path)
        elif suffix == ".json":
            records = _read_json(path)
        elif suffix == ".csv":
            with open(path, newline="", encoding="utf-8-sig") as f:
                records = list(csv.DictReader(f))
        elif _parquet_rows(path) == 0:  # datasets cannot build a table of none (a traceback)
            records = []
        else:
            import datasets

            records = datasets.Dataset.from_parquet(str(path))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (OSError, ValueError) as e:  # unreadable file, malformed CSV/parquet
        raise UserError(
            f"{path}: cannot be read: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e
    if len(records) == 0:
        raise UserError(f"{path}: holds no records")
    return RawSplit(str(path), records, fingerprint)


def _parquet_rows(path: Path) -> int:
    """The row count in a parquet file's footer (nothing else is read); a file that is not parquet
    is refused here in one line, before `datasets` logs its own error for it."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pyarrow.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None


def first_record(path: Path) -> object | None:
    """The first record of a local data file, read as :func:`read_file` reads the whole file: for
    the pre-flight check (zfctl/train/preflight.py), so that a file that cannot be read at all
    (not UTF-8, not parquet, no records) is refused before the plan prints. Only the start of the
    file is read; None for a .json list too large to peek into (the data pipeline checks it)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            if _parquet_rows(path) == 0:
                raise UserError(f"{path}: holds no records")
            import pyarrow.parquet as pq

            batch = next(pq.ParquetFile(path).iter_batches(batch_size=1))  # one row, not a row group
            return batch.to_pylist()[0]
        if suffix == ".json" and path.stat().st_size >= _JSON_PEEK_LIMIT:
            return None
        rec: object
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8-sig") as f:
                rec = next(csv.DictReader(f), None)
        elif suffix == ".json":
            records = _read_json(path)
            rec = records[0] if records else None
        else:
            rec = _first_jsonl(path)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    if rec is None:
        raise UserError(f"{path}: holds no records")
    return rec


_JSON_PEEK_LIMIT = 64 << 20  # a .json list must be parsed whole: only small ones are peeked into


_COUNT_LIMIT = 256 << 20  # JSON lines and CSV up to this size are counted before the plan (one read)


def count_records(path: Path) -> int | None:
    """The records of a local data file, counted as :func:`read_file` would find them, cheaply: a
    parquet footer, the non-blank lines of JSON lines, the rows of a CSV after its header, a small
    .json list parsed. None where that would cost more than a quick read (the pipeline counts)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            return _parquet_rows(path)
        if path.stat().st_size >= (_JSON_PEEK_LIMIT if suffix == ".json" else _COUNT_LIMIT):
            return None
        if suffix == ".json":
            return len(_read_json(path))
        with open(path, newline="", encoding="utf-8-sig") as f:
            if suffix == ".csv":
                return max(0, sum(1 for _ in csv.reader(f)) - 1)
            return sum(1 for line in f if line.strip())
    except (UnicodeDecodeError, csv.Error):  # refused with its own line where the records are read
        return None


def _first_jsonl(path: Path) -> object | None:
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}: line {lineno} (record 1) is not valid JSON: {e.msg}") from None
    return None


def _read_jsonl(path: Path) -> list:
    records = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"{path}: line {lineno} (record {len(records) + 1}) is not valid JSON: {e.msg}"
                    ) from None
    return records


def _read_json(path: Path) -> list:
    text = path.read_text(encoding="utf-8-sig")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("{") and "\n{" in text:  # JSON lines saved as .json
            return _read_jsonl(path)
        raise UserError(f"{path}: not valid JSON: {e.msg} (line {e.lineno})") from None
    if isinstance(data, dict):  # {"data": [...]}, the other common layout
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            data = lists[0]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of records (or JSON lines), got {type(data).__name__}")
    return data


def read_hub(repo: str, subset: str | None, split: str) -> RawSplit:
    """A split of a hub dataset via `datasets`, failing at once when the hub is unreachable."""
    where = f"hub dataset {repo}" + (f" ({subset})" if subset else "") + f" split {split!r}"
    if not model_hub.hub_offline_requested() and not model_hub.hub_reachable():
        raise ConfigError(
            "data.path",
            repo,
            f"the Hugging Face hub ({model_hub.hub_endpoint()}) cannot be "
            f"reached; use {LOCAL_DATA}, or set HF_HUB_OFFLINE=1 to use a copy already in the HF cache",
        )
    import datasets

    try:
        ds = datasets.load_dataset(repo, subset, split=split)
    except Exception as e:  # datasets raises many types (ValueError, FileNotFoundError, hub errors)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if model_hub.hub_offline_requested():
            fix = ("HF_HUB_OFFLINE=1 allows only datasets already in the HF cache: download it once with the "
                   f"hub reachable (HF_HUB_OFFLINE unset), or use {LOCAL_DATA}")
        else:
            fix = "check the dataset id, data.subset and data.split on its hub page"
        raise UserError(f"{where}: cannot be loaded: {msg.rstrip('.')}; {fix}") from e
    return RawSplit(where, ds, f"{repo}:{subset}:{split}:{ds._fingerprint}")
