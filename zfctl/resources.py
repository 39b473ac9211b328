"""Where the shipped presets, sample data and the embedded tokenizer live.

In a source checkout they sit in the top-level `presets/` folder; in an installed wheel the same
folder is packaged as `zfctl/presets` (see pyproject's package-dir mapping). Everything that reads
shipped files asks `presets_root()`, so both layouts work.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def presets_root() -> Path:
    """The folder holding models/, data/, zenflow/, samples/ and tokenizers/."""
    checkout = Path(__file__).resolve().parent.parent / "presets"
    if (checkout / "models").is_dir():
        return checkout
    packaged = Path(__file__).resolve().parent / "presets"
    if (packaged / "models").is_dir():
        return packaged
    raise FileNotFoundError(
        f"zfctl's presets folder is missing (looked in {checkout} and {packaged}); reinstall zfctl"
    )
