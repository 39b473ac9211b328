"""Quiet by default: the libraries' progress bars and banners are off unless ``--verbose``.

zfctl prints its own dense line per step and one line per phase. What the libraries add on top
is noise to a user and garbage in a log file (a bar redraws itself with carriage returns):
transformers' "Loading weights" and "Writing model shards" bars, the GGUF dequantisation bar of
the ``smollm2-135m`` preset, and torchrun's ``OMP_NUM_THREADS`` banner on every ``--nproc`` run.
Each is switched off through the environment variable its library reads when it is imported, so
this module imports none of them (the light verbs stay light) and the torchrun ranks inherit the
choice. A variable the user set keeps its value. ``--verbose`` leaves them all on and sets
``ZFCTL_VERBOSE``, which the ranks inherit too (zfctl/cli/finetune.py then prints the whole plan).
"""

from __future__ import annotations

import os

VERBOSE_ENV = "ZFCTL_VERBOSE"

# variable -> value that silences it; read by the library at import
QUIET_ENV = {
    # huggingface_hub's bars, and transformers' ("Loading weights", "Writing model shards"), which
    # start from huggingface_hub's setting (transformers/utils/logging.py, _tqdm_active)
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # datasets' own ("Map", "Saving the dataset")
    "TQDM_DISABLE": "1",  # bars that call tqdm directly: transformers' GGUF "Converting and de-quantizing"
}

# What torchrun sets for its workers when OMP_NUM_THREADS is not set, with a 4-line banner saying
# so (torch/distributed/run.py). zfctl sets the same value itself, so the ranks run exactly as
# before without the banner; the CPU AdamW's threads are zenflow.cpu_threads, not this.
TORCHRUN_OMP_THREADS = "1"


def set_verbose(verbose: bool) -> None:
    """Call first in a verb that loads models or starts processes, before transformers is imported.
    ``ZFCTL_VERBOSE=1`` in the environment is ``--verbose`` for every verb."""
    if verbose or is_verbose():
        os.environ[VERBOSE_ENV] = "1"
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)


def is_verbose() -> bool:
    """Whether this process, or the launcher that started it, was given ``--verbose``."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def torchrun_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a torchrun launch: OMP_NUM_THREADS as torchrun would set it, unless the user
    set a value. An empty or blank value counts as unset (libgomp rejects it with "Invalid value
    for environment variable OMP_NUM_THREADS" and uses every core), so zfctl never passes one on."""
    if not env.get("OMP_NUM_THREADS", "").strip():
        env = {**env, "OMP_NUM_THREADS": TORCHRUN_OMP_THREADS}
    return env
