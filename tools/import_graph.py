"""The package's import graph in numbers: modules, floors, arrows, lines.

Usage::

    python tools/import_graph.py            # module-level imports (what runs at import)
    python tools/import_graph.py --lazy     # imports inside functions counted too

An arrow is one module importing another (`from vartrace.x import y` is an arrow to
`vartrace.x`, and to `vartrace.x.y` when that is a module); a module's floor is one above the
highest floor it imports, so the floors count the longest chain of imports.  A circle makes
the floors undefined and is printed instead.  `tests/test_layout.py` holds the rules; this
prints the measures of the graph they shape.
"""

from __future__ import annotations

import argparse
import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vartrace"


def modules() -> dict[str, Path]:
    """Module name -> its file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path], lazy: bool) -> set[str]:
    """The package modules `path` imports (inside functions too when `lazy`)."""
    tree = ast.parse(path.read_text())
    inside = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in inside and not lazy:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vartrace"):
            module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found & set(known)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lazy", action="store_true", help="count imports inside functions")
    args = parser.parse_args()
    known = modules()
    edges = {name: imports(path, known, args.lazy) - {name} for name, path in known.items()}
    try:
        order = list(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as error:
        print(f"a circle: {' -> '.join(error.args[1])}")
        return
    floor: dict[str, int] = {}
    for name in order:
        floor[name] = 1 + max((floor[m] for m in edges[name]), default=0)
    lines = sorted(len(path.read_text().splitlines()) for path in known.values())
    print(
        f"{len(known)} modules on {max(floor.values())} floors, "
        f"{sum(map(len, edges.values()))} arrows; {sum(lines)} lines, "
        f"median {lines[len(lines) // 2]} a module, the largest {lines[-1]}"
    )


if __name__ == "__main__":
    main()
