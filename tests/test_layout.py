"""The analysis code is laid out one concept per module, with imports flowing one way."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "vartrace"


def _imports(path: Path) -> set[str]:
    """Every ``vartrace.*`` module a file imports, at any level (``TYPE_CHECKING`` included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vartrace"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vartrace"))
    return found


def _graph(package: str) -> dict[str, set[str]]:
    folder = PACKAGE / package
    modules = {
        f"vartrace.{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"
    }
    return {name: _imports(path) & set(modules) for name, path in modules.items()}


def test_sources_is_a_package_of_one_concept_per_module_without_cycles() -> None:
    graph = _graph("sources")
    assert set(graph) == {
        f"vartrace.sources.{name}"
        for name in ("statistics", "frames", "buffers", "chunk_maps", "views", "source")
    }
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises on a cycle
    assert order.index("vartrace.sources.statistics") < order.index("vartrace.sources.views")
    assert order.index("vartrace.sources.views") < order.index("vartrace.sources.source")


def test_comparison_modules_import_one_way() -> None:
    graph = _graph("comparison")
    list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a circle
    assert "vartrace.comparison._engine" not in graph["vartrace.comparison.report"]
    assert "vartrace.comparison.report" in graph["vartrace.comparison._engine"]
