"""No two modules of zfctl/plan import each other, not even for an annotation.

tests/train/test_import_cycles.py leaves ``if TYPE_CHECKING:`` imports out (they never run); a
reader still holds both modules in mind. lines.py and verdict.py did (verdict.py named
``MemoryItem`` for its annotations, lines.py asked verdict.py ``host_limit``): the estimate's data
types live in items.py now, which both import.
"""

from __future__ import annotations

import ast
from pathlib import Path

PLAN = Path(__file__).resolve().parents[2] / "zfctl" / "plan"


def named_modules(path: Path) -> set[str]:
    """The zfctl.plan modules ``path`` imports anywhere (TYPE_CHECKING blocks and functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "zfctl.plan":
                out |= {f"zfctl.plan.{a.name}" for a in node.names}
            else:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("zfctl.plan.")}


def test_no_two_plan_modules_import_each_other() -> None:
    graph = {f"zfctl.plan.{p.stem}": named_modules(p) for p in PLAN.glob("*.py")}
    both = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, set()))
    assert both == [], both
