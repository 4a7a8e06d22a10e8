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
    folder = PACKAGE.joinpath(*package.split("."))
    modules = {
        f"vartrace.{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"
    }
    return {name: _imports(path) & set(modules) for name, path in modules.items()}


def test_sources_is_a_package_of_one_concept_per_module_without_cycles() -> None:
    graph = _graph("analysis.sources")
    assert set(graph) == {
        f"vartrace.analysis.sources.{name}"
        for name in ("frames", "buffers", "chunk_maps", "views", "source")
    }
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises on a cycle
    assert order.index("vartrace.analysis.sources.views") < order.index(
        "vartrace.analysis.sources.source"
    )


def test_statistics_is_one_package_the_analysis_side_imports_never_the_reverse() -> None:
    graph = _graph("statistics")
    assert set(graph) == {
        f"vartrace.statistics.{name}"
        for name in ("fields", "records", "kernels", "named", "_triton")
    }
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises on a cycle
    assert order.index("vartrace.statistics.fields") < order.index("vartrace.statistics.records")
    assert order.index("vartrace.statistics.records") < order.index("vartrace.statistics.named")
    outside = {
        imported
        for path in (PACKAGE / "statistics").glob("*.py")
        for imported in _imports(path)
        if not imported.startswith("vartrace.statistics")
    }
    assert not {
        m for m in outside if m.startswith(("vartrace.analysis.sources", "vartrace.storage"))
    }
    assert not {
        m
        for m in outside
        if m.startswith(("vartrace.analysis.comparison", "vartrace.analysis.plot"))
    }
    users = [
        p for p in (PACKAGE / "analysis" / "sources").glob("*.py") if "vartrace.statistics.named" in _imports(p)
    ]
    assert users, "the read side computes its named statistics from vartrace.statistics"


def test_comparison_modules_import_one_way() -> None:
    graph = _graph("analysis.comparison")
    list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a circle
    assert (
        "vartrace.analysis.comparison._engine" not in graph["vartrace.analysis.comparison.report"]
    )
    assert "vartrace.analysis.comparison.report" in graph["vartrace.analysis.comparison._engine"]
