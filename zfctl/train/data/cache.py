"""The tokenised-data cache: tokenise once, reload in milliseconds (memory-mapped Arrow).

An entry is a `datasets.DatasetDict` saved under ``<cache>/data/<name>-<key>/``. The key hashes
everything the token sequences depend on: the data config (the template included), the tokenizer
(its full serialised form), for template chat the chat template's text, the template version,
the source files' content digests (or the hub dataset's fingerprint) and the seed of the held-out split. Entries are written to a temporary folder and renamed, so
concurrent preparers (one per node, or a run and a `zfctl plan`) never see half an entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from zfctl.plan.schema import DataConfig

META = "zfctl-data.json"  # stats of the entry
_NOT_IN_KEY = {"description"}  # fields that do not change the token sequences


def cache_root() -> Path:
    """Where zfctl caches derived files: ``$ZFCTL_CACHE_DIR`` or ``~/.cache/zfctl``."""
    return Path(os.environ.get("ZFCTL_CACHE_DIR") or Path.home() / ".cache" / "zfctl").expanduser()


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides how the tokenizer maps text to ids."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow (Python) tokenizer: vocabulary and specials are what we can see
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)).encode())
    return h.hexdigest()


def cache_key(cfg: DataConfig, tokenizer_fp: str, source_fp: str, *, seed: int, template_version: int,
              chat_template: str | None = None) -> str:
    """Hex key of one prepared dataset (``chat_template``: the text a chat run renders with)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _NOT_IN_KEY}
    blob = json.dumps(
        {
            "cfg": fields,
            "tok": tokenizer_fp,
            "src": source_fp,
            "tv": template_version,
            "chat": chat_template,
            # the seed only decides which records are held out for evaluation
            "seed": seed if cfg.validation_split is None else None,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def entry_dir(cache_dir: Path, name: str, key: str) -> Path:
    """The folder of one entry; the readable prefix helps a human clear the cache by hand."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name)[:40] or "data"
    return cache_dir / f"{slug}-{key}"


def load(path: Path):
    """(DatasetDict, meta dict) cached at `path`, or None when absent or damaged (then rebuilt)."""
    if not (path / META).is_file():  # written last into the entry: its presence means complete
        return None
    import datasets

    try:
        return datasets.load_from_disk(str(path)), json.loads((path / META).read_text())
    except (OSError, ValueError):  # damaged entry: rebuild rather than fail the run
        return None


def save(dsd, meta: dict, path: Path) -> None:
    """Write `dsd` and `meta` to `path` atomically (temp folder + rename); a lost race keeps the winner."""
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bar per split per save is noise next to the run display
    try:
        dsd.save_to_disk(str(tmp))
        (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        if path.exists() and load(path) is None:  # a damaged entry (e.g. a killed old writer)
            shutil.rmtree(path, ignore_errors=True)
        try:
            tmp.rename(path)
        except OSError:
            if load(path) is None:
                raise
    finally:
        if bars:
            datasets.enable_progress_bars()
        shutil.rmtree(tmp, ignore_errors=True)
