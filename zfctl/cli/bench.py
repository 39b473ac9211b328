"""`zfctl bench`: placeholder until the benchmark lands (the bench issue replaces this module)."""

from __future__ import annotations

from typing import Optional

import typer

from zfctl.errors import UserError


def bench(
    topk: Optional[str] = typer.Option(None, "--topk", help="Comma list of topk ratios."),
    interval: Optional[str] = typer.Option(None, "--interval", help="Comma list of update intervals."),
) -> None:
    """Synthetic ZenFlow benchmark (step time split, stalls, PCIe bytes) - not available yet."""
    raise UserError("zfctl bench is not available yet in this build")
