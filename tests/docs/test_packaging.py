"""What the distribution ships: the typing marker, the licence, its metadata, the exports."""

from __future__ import annotations

import email
import pydoc
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import vartrace

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel pip builds from a copy of this checkout's sources (no dependencies, no build
    isolation; the copy keeps setuptools' build folder out of the checkout)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "vartrace", source / "vartrace", ignore=shutil.ignore_patterns("__pycache__")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("torch_vartrace-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_ships_the_typing_marker_and_the_licence(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert "vartrace/py.typed" in names
    assert any(name.endswith("LICENSE") for name in names), names
    licence = next(name for name in names if name.endswith("LICENSE"))
    assert wheel.read(licence).decode().startswith("MIT License")


def test_the_metadata_names_authors_and_project_urls(wheel: zipfile.ZipFile) -> None:
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    message = email.message_from_bytes(wheel.read(metadata))
    assert message["Name"] == "torch-vartrace"
    assert "vartrace developers" in (message["Author"] or "")
    urls = dict(url.split(", ", 1) for url in message.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls)
    assert all(url.startswith("https://") for url in urls.values())
    extras = set(message.get_all("Provides-Extra"))
    assert {"docs", "typecheck", "tensorboard", "xarray", "compress", "test"} <= extras
    test_requirements = [r for r in message.get_all("Requires-Dist") if 'extra == "test"' in r]
    assert not any(r.startswith("hdf5plugin") for r in test_requirements), (
        "hdf5plugin (186 MB) stays out of the test extra; its tests skip without it"
    )


def test_run_and_site_are_exported() -> None:
    from vartrace.storage.reader import Run, Site

    assert vartrace.Run is Run and vartrace.Site is Site
    assert {"Run", "Site"} <= set(vartrace.__all__) <= set(dir(vartrace))


def test_help_on_the_tracer_shows_its_options_and_results() -> None:
    text = pydoc.render_doc(vartrace.ModelTracer, renderer=pydoc.plaintext)
    for option in (
        "pre_save_callbacks",
        "post_gather_callbacks",
        "gathering_interval",
        "trace_interval",
        "change_detection",
        "staging",
        "max_inflight_bytes",
    ):
        assert f"{option}:" in text, option
    results = text.split("results\n", 1)[1]
    assert "post-gather callbacks left" in results.split("\n\n", 1)[0]
