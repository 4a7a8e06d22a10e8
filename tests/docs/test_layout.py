"""The analysis code is laid out one concept per module, with imports flowing one way."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "vartrace"


def _imports(path: Path) -> set[str]:
    """Every ``vartrace.*`` module a file imports, at any level (``TYPE_CHECKING`` included):
    ``from vartrace.tracing import registry`` imports ``vartrace.tracing.registry``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vartrace"):
            found.add(node.module)
            found.update(
                f"{node.module}.{a.name}"
                for a in node.names
                if _is_module(f"{node.module}.{a.name}")
            )
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vartrace"))
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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
        for name in ("fields", "records", "kernels", "compiled", "named", "triton_kernel", "rows")
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
        p
        for p in (PACKAGE / "analysis" / "sources").glob("*.py")
        if "vartrace.statistics.named" in _imports(p)
    ]
    assert users, "the read side computes its named statistics from vartrace.statistics"


def test_comparison_modules_import_one_way() -> None:
    graph = _graph("analysis.comparison")
    list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a circle
    assert "vartrace.analysis.comparison.engine" not in graph["vartrace.analysis.comparison.report"]
    assert "vartrace.analysis.comparison.report" in graph["vartrace.analysis.comparison.engine"]


# -- the whole package: layers, sizes, docstrings ---------------------------------------------

#: The package's layers, bottom first.  A module may import its own package, or any package of a
#: lower layer, or of its own layer where that layer allows it: the three packages between the
#: tracer and the file do not import one another (the tracer hands records to each of them,
#: none of them hands records to another), nor do the public front ends.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"vartrace._support", "vartrace._version", "vartrace.errors", "vartrace.markers"}),
    frozenset(
        {
            "vartrace.engine",
            "vartrace.trace",
            "vartrace.reduced",
            "vartrace.placements",
            "vartrace.tensors",
        }
    ),
    frozenset({"vartrace.statistics"}),
    frozenset({"vartrace.staging", "vartrace.distributed", "vartrace.storage"}),
    frozenset({"vartrace.tracing"}),
    frozenset({"vartrace.analysis"}),
    frozenset({"vartrace.cli", "vartrace.plot", "vartrace.tensorboard"}),
    frozenset({"vartrace.__main__"}),
)
#: Layers whose units do not import one another.
APART = frozenset({3, 6})
#: Convenience methods of user-facing objects that hand over to the analysis layer, imported in
#: the method's body when it is called: (importing module, imported module).
LAZY_CONVENIENCES: frozenset[tuple[str, str]] = frozenset(
    {
        ("vartrace.storage.reader", "vartrace.analysis.sources.frames"),  # Run.to_frame
        ("vartrace.tracing.results", "vartrace.analysis.sources.frames"),  # Results.to_frame
        ("vartrace.storage.reader", "vartrace.analysis.dask_frames"),  # to_frame(scheduler=)
        ("vartrace.storage.reader", "vartrace.analysis.dask_arrays"),  # Run.to_dask
        ("vartrace.storage.sites", "vartrace.analysis.dask_arrays"),  # to_xarray(chunks=)
        ("vartrace.storage.sites", "vartrace.analysis.sources.frames"),  # Site.to_frame
    }
)
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _unit(module: str) -> str:
    """The layered unit a module belongs to: its package below `vartrace`, or itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _layer(module: str) -> int:
    unit = _unit(module)
    for level, units in enumerate(LAYERS):
        if unit in units:
            return level
    raise AssertionError(f"{module} is in no layer of tests/docs/test_layout.py's LAYERS")


def _lazy_imports(path: Path) -> set[str]:
    """The ``vartrace.*`` modules a file imports inside function bodies."""
    found: set[str] = set()
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vartrace"):
                    found.add(node.module or "")
                elif isinstance(node, ast.Import):
                    found.update(a.name for a in node.names if a.name.startswith("vartrace"))
    return found


def test_every_module_imports_only_its_own_layer_or_lower_ones() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if name == "vartrace":
            continue  # the package's front door re-exports every layer (lazily)
        lazy = _lazy_imports(path)
        for imported in _imports(path):
            if imported == "vartrace":
                wrong.append(f"{name} imports the package's front door (vartrace/__init__.py)")
                continue
            if (name, imported) in LAZY_CONVENIENCES and imported in lazy:
                continue
            mine, theirs = _unit(name), _unit(imported)
            if mine == theirs:
                continue
            if _layer(imported) > _layer(name):
                wrong.append(f"{name} (layer {_layer(name)}) imports {imported} (layer up)")
            elif _layer(imported) == _layer(name) and _layer(name) in APART:
                wrong.append(f"{name} imports {imported}, a sibling of its own layer")
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_circle() -> None:
    modules = _modules()
    graph = {
        name: {m for m in _imports(path) - _lazy_imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a circle


def test_no_module_is_over_700_lines_and_every_module_says_its_job() -> None:
    too_long, silent = [], []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        if not ast.get_docstring(ast.parse(text)):
            silent.append(name)
    assert not too_long, too_long
    assert not silent, f"modules without a docstring: {silent}"


#: The only calls up a layer on a record's way to the file: callables handed down at start
#: (the engine's hook calls the tracer's capture; a staging keeps records in the tracer's
#: chunk and runs its hand-over).
HANDED_DOWN = {
    ("engine.patching", "tracing.tracer"),
    ("staging.{}", "tracing.chunk"),
    ("staging.{}", "tracing.handover"),
}


@pytest.mark.parametrize("staging", ["sync", "async"])
def test_a_record_climbs_up_a_layer_only_through_callables_handed_down(staging: str) -> None:
    """`tools/record_walk.py` walks one record from admission to the file, on every thread."""
    tool = PACKAGE.parent / "tools" / "record_walk.py"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(tool), "--staging", staging],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("calls from a lower")))
    climbs = {(line.split()[0], line.split()[4]) for line in lines[start + 1 :] if " -> " in line}
    room = "blocking" if staging == "sync" else "stager"
    assert climbs == {(low.format(room), high) for low, high in HANDED_DOWN}, done.stdout
    assert "storage.site_writer" in done.stdout  # the record reached the file's writer
