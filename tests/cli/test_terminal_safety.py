"""What the ``vartrace`` command prints never drives the terminal.

A site name comes from any dict key of the traced code and a run file from anyone, so a
name or a ``/meta`` string could clear or forge the screen (CSI), set the window title
(OSC 0), write the clipboard (OSC 52), ring the bell, reorder text (bidi overrides) or
forge lines (a newline).  Real runs are recorded by the real tracer and saver (hostile dict
keys, hostile command-line arguments in the metadata), then every command runs as a real
subprocess: no such character reaches stdout or stderr, and its escaped form is shown.
"""

from __future__ import annotations

import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from tests.cli.test_cli import vartrace

#: Dict keys of the traced code, each a site name ``forward.parts.<key>``.
KEYS = [
    "csi\x1b[2Jcleared",  # CSI: clears the screen
    "title\x1b]0;owned\x07",  # OSC 0, ended by BEL: sets the window title
    "clip\x1b]52;c;ZXZpbA==\x07",  # OSC 52: writes the clipboard
    "bell\x07",
    "nul\x00byte",
    "bidi\u202eevil\u2066x\u2069",  # right-to-left override, an isolate
    "c1\x9b2J",  # CSI as one C1 character
    "erase\x08\x7f",  # backspace, DEL
    "over\rwritten",
    "new\nforged line",
]
#: Command-line arguments of the run, stored in ``/meta/command``.
ARGUMENTS = ["--note=\x1b]0;owned\x07", "--title=\x1b[31mred\x1b[0m", "\u202eevil", "a\nforged"]
#: The folder the runs are written in (``/meta/cwd``) and read from.
FOLDER = "runs\x1b]0;owned\x07\nforged"

TRAIN = """
import sys
import torch
from torch import nn
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.tracing.tracer import ModelTracer

KEYS = {keys!r}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        parts = {{key: x * (i + 1) for i, key in enumerate(KEYS[:int(sys.argv[2])])}}
        assert parts
        return self.lin(x)


model = Net()
scale = float(sys.argv[3])
with H5PYSaverCallback(sys.argv[1]) as saver, ModelTracer(
    model, ["forward.parts.*"], post_gather_callbacks=[saver]
):
    model(torch.ones(1, 2) * scale)
"""


def escaped(text: str) -> str:
    """How ``text`` (printable ASCII but for its control and format characters) shows."""
    return text.encode("unicode_escape").decode("ascii")


def raw_controls(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on, but for the newlines ending lines."""
    hidden = {"Cc", "Cf", "Cs", "Zl", "Zp"}
    return [c for c in text if c != "\n" and unicodedata.category(c) in hidden]


def shown(result: subprocess.CompletedProcess[str]) -> str:
    """stdout and stderr of a command, checked to hold no raw control character."""
    for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        assert not raw_controls(text), (stream, raw_controls(text), text)
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``a.h5``: every hostile site; ``b.h5``: all but the last three, other values."""
    root = tmp_path_factory.mktemp("hostile") / FOLDER
    root.mkdir()
    script = root / "train.py"
    script.write_text(TRAIN.format(keys=KEYS))
    for name, count, scale in (("a.h5", len(KEYS), 1.0), ("b.h5", len(KEYS) - 3, 2.0)):
        command = [sys.executable, str(script), name, str(count), str(scale), *ARGUMENTS]
        subprocess.run(command, cwd=root, check=True, timeout=120)
    return root


def test_ls_shows_hostile_site_names_escaped_one_line_each(runs: Path) -> None:
    result = vartrace("ls", runs / "a.h5", cwd=runs)
    assert result.returncode == 0, result.stderr
    text = shown(result)
    lines = result.stdout.splitlines()
    assert len(lines) == 3 + len(KEYS), text  # the summary, the header, its rule, a row a site
    assert lines[0].startswith(escaped(f"{runs / 'a.h5'}: 10 sites")), lines[0]
    for row, key in zip(lines[3:], KEYS, strict=True):
        assert row.startswith(escaped(f"forward.parts.{key}") + " "), row
    assert len({row.index(" 1  ") for row in lines[3:]}) == 1, text  # the columns stay aligned


def test_show_prints_hostile_site_names_escaped(runs: Path) -> None:
    for args in (["forward.parts.*"], ["forward.parts.*", "--iteration", "1"]):
        result = vartrace("show", "a.h5", *args, cwd=runs)
        assert result.returncode == 0, result.stderr
        text = shown(result)
        for key in KEYS:
            assert escaped(f"forward.parts.{key}") in text, (key, text)
        assert not any(line.startswith("forged") for line in text.splitlines())


def test_an_error_naming_hostile_sites_is_one_escaped_line(runs: Path) -> None:
    """``show`` of a missing site suggests the closest names (raw from the file) on stderr."""
    result = vartrace("show", "a.h5", "forward.parts.csi[2Jcleared", cwd=runs)
    assert result.returncode == 2
    shown(result)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert escaped("forward.parts.csi\x1b[2Jcleared") in result.stderr


def test_meta_shows_hostile_strings_escaped(runs: Path) -> None:
    """A list's entries are escaped whole; a text of several lines (the git diff, here the
    working folder) prints as a block indented under its key, each line escaped."""
    for args in ([], ["command"]):
        result = vartrace("meta", "a.h5", *args, cwd=runs)
        assert result.returncode == 0, result.stderr
        text = shown(result)
        for argument in ARGUMENTS:
            assert escaped(argument) in text, (argument, text)
        assert not any(line.startswith("forged") for line in text.splitlines())
    lines = vartrace("meta", "a.h5", "cwd", cwd=runs).stdout.splitlines()
    first, second = FOLDER.split("\n")
    assert lines == ["cwd  |", f"    {escaped(str(runs.parent / first))}", f"    {second}"]


def test_compare_shows_hostile_site_names_escaped(runs: Path) -> None:
    result = vartrace("compare", "a.h5", "b.h5", cwd=runs)
    assert result.returncode == 1, result.stdout + result.stderr
    text = shown(result)
    for key in KEYS:
        assert escaped(f"forward.parts.{key}".split("\n")[0]) in text, (key, text)
    only_in_a = next(line for line in text.splitlines() if line.startswith("only in a"))
    assert escaped(f"forward.parts.{KEYS[-3]}") in only_in_a


def test_compare_shows_a_newline_inside_a_site_name_escaped(runs: Path) -> None:
    result = vartrace("compare", "a.h5", "b.h5", cwd=runs)
    assert escaped("forward.parts.new\nforged line") in result.stdout
    assert not any(line.startswith("forged") for line in result.stdout.splitlines())


def test_plot_prints_library_warnings_about_hostile_names_escaped(
    runs: Path, tmp_path: Path
) -> None:
    """matplotlib warns of each glyph of a legend's site name its font lacks (ESC, BEL,
    NUL...), quoting the glyph: the command prints Python's warnings escaped too."""
    out = tmp_path / "plot.png"
    result = vartrace("plot", "a.h5", "forward.parts.*", "-o", out, cwd=runs)
    assert result.returncode == 0, result.stderr
    shown(result)
    assert out.is_file()


def test_sites_shows_hostile_module_names_escaped(tmp_path: Path) -> None:
    """A module registered under a name with control characters (``add_module`` allows them)."""
    (tmp_path / "factory.py").write_text(
        "from torch import nn\n\n\n"
        "def build():\n"
        "    model = nn.Sequential()\n"
        f"    model.add_module({KEYS[0]!r}, nn.Linear(2, 2))\n"
        "    return model\n"
    )
    result = vartrace("sites", "factory.py:build", "**.forward", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown(result)
    assert f"{escaped(KEYS[0])}.forward" in result.stdout.splitlines()
