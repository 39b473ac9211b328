"""No two zfctl modules import each other, directly or around a longer circle.

The imports are read statically (ast), including those inside functions: a lazy import hides a
circle from Python's import machinery but not from a reader who has to hold both modules in
mind. Imports under ``if TYPE_CHECKING:`` are left out: they never run, and naming a caller's
class in an annotation is no dependency.
``from package import name`` counts as an import of the submodule when ``name`` is one, else of
the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "zfctl") -> nx.DiGraph:
    """Edges ``a -> b``: module ``a`` names ``b`` in an import statement (both inside ``package``)."""
    files = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                if target in files and target != mod:
                    graph.add_edge(mod, target)
    return graph


def _is_type_checking(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    """Every strongly connected group of two or more modules (each holds at least one circle)."""
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def test_zfctl_has_no_import_cycle() -> None:
    found = cycles(import_graph(ROOT))
    assert not found, f"modules that import each other (directly or in a circle): {found}"


@pytest.mark.parametrize("lazy", [False, True])
def test_a_planted_cycle_is_found(tmp_path: Path, lazy: bool) -> None:
    pkg = tmp_path / "zfctl"
    (pkg / "train").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train" / "__init__.py").write_text("")
    indent = "def f():\n    " if lazy else ""
    (pkg / "train" / "dist.py").write_text(f"{indent}from zfctl.train.session import load_inputs\n")
    (pkg / "train" / "session.py").write_text("from zfctl.train import dist\n")
    (pkg / "train" / "loop.py").write_text("from . import session\n")
    # a typing-only import back is no circle
    (pkg / "train" / "metrics.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    from zfctl.train.display import x\n")
    (pkg / "train" / "display.py").write_text("from zfctl.train import metrics\n")
    assert cycles(import_graph(tmp_path)) == [["zfctl.train.dist", "zfctl.train.session"]]
