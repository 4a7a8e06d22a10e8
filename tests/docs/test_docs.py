"""The README is a front door into docs/, and docs/ builds as a strict MkDocs site."""

from __future__ import annotations

import html
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation built strictly, as CI builds it, into a temporary folder."""
    if (
        importlib.util.find_spec("mkdocs") is None
        or importlib.util.find_spec("mkdocstrings") is None
    ):
        pytest.skip("needs the docs extra: pip install -e '.[docs]'")
    site_dir = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    return site_dir


def test_the_site_builds_strictly(site: Path) -> None:
    api = (site / "api" / "index.html").read_text()
    for name in ("vartrace.ModelTracer", "vartrace.Run", "vartrace.Site", "vartrace.open"):
        assert f'id="{name}"' in api, name
    assert "gathering_interval" in api


def test_the_api_page_lists_every_public_name(site: Path) -> None:
    import vartrace

    api = (site / "api" / "index.html").read_text()
    rendered = set(re.findall(r'id="(vartrace\.[\w.]+)"', api))
    public = {name for name in vartrace.__all__ if not name.startswith("_")}
    missing = [
        name
        for name in sorted(public)
        if not {f"vartrace.{name}", f"vartrace.{name}.{name}"} & rendered
        and not any(i.startswith("vartrace.") and i.endswith(f".{name}") for i in rendered)
    ]
    assert not missing, f"docs/api.md renders no entry for {missing}"


_REST_ROLE = re.compile(r":(?:data|func|class|meth|mod|attr|exc|obj):")


def test_no_page_shows_raw_rest(site: Path) -> None:
    """Docstrings are markdown: no reST literal block (a line ending in `::`) and no role."""
    shown = []
    for page in sorted(site.rglob("*.html")):
        text = html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))
        for line in text.splitlines():
            if line.rstrip().endswith("::") or _REST_ROLE.search(line):
                shown.append(f"{page.relative_to(site)}: {line.strip()[:120]}")
    assert not shown, "\n".join(shown)


def _code_lines(markdown: Path) -> list[str]:
    lines, fence = [], None
    for line in markdown.read_text().splitlines():
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            fence, language = "```", stripped[3:]
        elif fence is not None and stripped == fence:
            fence = None
        elif fence is not None and language in ("python", "bash"):
            lines.append(line)
    return lines


def test_code_blocks_fit_a_page_without_scrolling() -> None:
    """A line of code (a python or bash block) scrolls off a page past 88 columns, comments
    included; pasted output (text blocks) is shown as the command printed it."""
    pages = sorted(DOCS.rglob("*.md"))
    wide = [
        f"{page.relative_to(ROOT)}: {line}"
        for page in pages
        for line in _code_lines(page)
        if len(line) > 88
    ]
    assert not wide, "\n".join(wide)


def test_the_cli_page_has_a_section_per_command_with_its_options() -> None:
    from vartrace.cli import _parser

    page = (DOCS / "cli.md").read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", page, flags=re.M | re.S))
    commands = next(a for a in _parser()._actions if a.dest == "command").choices
    assert set(commands) <= set(sections), sorted(set(commands) - set(sections))
    for name, command in commands.items():
        options = [
            o for a in command._actions for o in a.option_strings if o not in ("-h", "--help")
        ]
        missing = [o for o in options if f"`{o}" not in sections[name]]
        assert not missing, f"## {name} in docs/cli.md does not show {missing}"
        assert f"```bash\nvartrace {name} " in sections[name], f"## {name}: no example"
        assert "```text\n" in sections[name], f"## {name}: no example output"
