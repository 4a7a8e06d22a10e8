"""The README is a front door into docs/, and docs/ builds as a strict MkDocs site."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _local_links(markdown: Path) -> list[Path]:
    links = [m.group(1) for m in _LINK.finditer(markdown.read_text())]
    return [markdown.parent / link for link in links if "://" not in link]


def test_the_readme_is_a_front_door_linking_into_the_docs() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert len(text.splitlines()) < 250, "the long reference belongs in docs/"
    links = _local_links(readme)
    missing = [str(link.relative_to(ROOT)) for link in links if not link.exists()]
    assert not missing, missing
    linked = {link.resolve() for link in links}
    for page in ("quickstart.md", "paths.md", "format.md", "cli.md", "benchmarks.md"):
        assert (DOCS / page).resolve() in linked, page
    # Read top-down, the CPU-torch line comes before the two commands.
    cpu = text.index("--index-url https://download.pytorch.org/whl/cpu")
    assert cpu < text.index("examples/quickstart.py\n") < text.index("-m pytest\n")


def test_every_page_is_in_the_navigation_and_every_local_link_resolves() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert pages, "docs/ holds the documentation"
    assert [p for p in pages if f": {p}\n" not in config] == []
    broken = [
        f"{page.relative_to(ROOT)} -> {link}"
        for page in DOCS.rglob("*.md")
        for link in _local_links(page)
        if not link.exists()
    ]
    assert not broken, broken


def test_the_how_to_guides_cover_the_tasks() -> None:
    guides = {p.stem for p in (DOCS / "howto").glob("*.md")}
    assert {"attention", "gradients", "ddp", "compare", "memory", "other-tools"} <= guides


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="needs the docs extra: pip install -e '.[docs]'",
)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("vartrace.ModelTracer", "vartrace.Run", "vartrace.Site", "vartrace.open"):
        assert f'id="{name}"' in api, name
    assert "gathering_interval" in api
