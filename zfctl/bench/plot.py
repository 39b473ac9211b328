"""`--plot FILE.png`: step time per configuration and the share of it spent stalled.

matplotlib is an optional extra (`pip install 'zfctl[plot]'`); `require_matplotlib()` runs before
the benchmark starts, so a missing install costs the user a one-line error, not a finished run.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from zfctl.bench.report import settings_line, write_atomic
from zfctl.errors import UserError


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(
            "--plot needs matplotlib, which is not installed: pip install 'zfctl[plot]' "
            "(or pip install matplotlib), or drop --plot"
        ) from None


def plot(rows: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    """Two panels: mean step ms by step kind (grouped bars), and stall % of step time."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    labels = [f"{i}. {r['label']}" for i, r in enumerate(rows, 1)]
    ys = range(len(rows))
    fig, (ax_t, ax_s) = plt.subplots(
        1, 2, figsize=(13, 1.2 + 0.55 * len(rows)), sharey=True, gridspec_kw={"width_ratios": [3, 1]}
    )
    kinds = (("accumulate", "accumulation steps"), ("update", "update steps"), ("overall", "all steps"))
    h = 0.8 / len(kinds)
    for k, (key, name) in enumerate(kinds):
        vals = [r["step_ms"][key]["mean"] for r in rows]
        # A kind that a configuration does not have is left out, not drawn as a zero-length bar.
        pts = [(y + (k - 1) * h, v) for y, v in zip(ys, vals) if v is not None]
        ax_t.barh([p[0] for p in pts], [p[1] for p in pts], height=h, label=name)
    ax_t.set_yticks(list(ys), labels)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("mean step time, ms")
    ax_t.legend(loc="lower right", fontsize="small")
    ax_t.set_title(f"{meta['model']} - {meta['device']}\n{settings_line(meta)}", fontsize="medium", loc="left")

    stall = [100 * (r["stall_fraction"] or 0.0) for r in rows]
    ax_s.barh(list(ys), stall, color="tab:red")
    ax_s.set_xlabel("stall, % of step time")
    ax_s.set_xlim(0, max(100.0, max(stall, default=0)))
    fig.tight_layout()

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
