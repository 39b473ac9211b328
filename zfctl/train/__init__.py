"""Training: models, data, the loop, checkpoints, exact resume and export.

The CLI calls three functions: :func:`run` (a fresh run from a RunPlan), :func:`resume` (continue
from a checkpoint or run folder) and :func:`export` (a checkpoint -> a transformers folder).
Submodules are imported lazily by these so that `import zfctl.train` stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zfctl.plan.schema import RunPlan
    from zfctl.train.progress import RunResult

__all__ = ["RunResult", "export", "resume", "run"]


def run(plan: RunPlan, *, force: bool = False, debug_data: bool = False) -> RunResult:
    """Fine-tune as ``plan`` says (see :func:`zfctl.train.session.run`)."""
    from zfctl.train.session import run as _run

    return _run(plan, force=force, debug_data=debug_data)


def resume(ckpt_dir: Path, *, max_steps: int | None = None, allow_changes: bool = False,
           on_plan: Callable[[RunPlan], None] | None = None, latest_good: bool = False) -> RunResult:
    """Continue a run exactly where a checkpoint left it (see :func:`zfctl.train.session.resume`)."""
    from zfctl.train.session import resume as _resume

    return _resume(Path(ckpt_dir), max_steps=max_steps, allow_changes=allow_changes, on_plan=on_plan,
                   latest_good=latest_good)


def export(ckpt_dir: Path, output: Path, *, force: bool = False, push_to_hub: str | None = None) -> Path:
    """Write a transformers folder from a checkpoint (see :func:`zfctl.train.hf_export.export`)."""
    from zfctl.train.hf_export import export as _export

    return _export(Path(ckpt_dir), Path(output), force=force, push_to_hub=push_to_hub)


def __getattr__(name: str) -> object:
    if name == "RunResult":
        from zfctl.train.progress import RunResult

        return RunResult
    raise AttributeError(name)
