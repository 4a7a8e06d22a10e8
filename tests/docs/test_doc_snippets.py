"""Every code snippet in README.md and docs/ runs as written.

Each fenced ```python block runs in a fresh namespace, in a temporary folder; each ```bash
block runs its `vartrace ...` lines as real CLI subprocesses there (its other lines, `pip
install` and the like, are a reader's setup and are not run).  A snippet that cannot run
here is marked in the markdown, on the line before its fence, with
`<!-- snippet: skip (the reason) -->`, and is reported as skipped with that reason.

The prelude: what a snippet may use without defining it, as the pages say ("your model,
your loop"):

- `model`: a small transformer (`TinyGPT`): `forward(tokens)` holds `tokens`; two blocks
  `layers.0`, `layers.1`, each an `attn` (whose `forward` holds `scores`) and an `mlp`
  (whose `forward` holds `h`); a `head` linear layer.  `model(batch)` returns an output
  with `.logits` and `.loss`.
- `loader`: four batches of tokens; `optimizer`: SGD on the model; `train(model)`: one
  pass over `loader` (forward, backward, step); `paths`: `["layers.*.attn.forward.scores"]`.
- `torch`, `nn`, `vartrace`, `ModelTracer`, `H5PYSaverCallback` imported.
- Files in the folder: `run.h5` (300 iterations of the model: `forward.tokens`,
  `layers.*.attn.forward.scores`, `layers.*.mlp.forward.h` and a recorded `loss`; also as
  `attn.h5` and `exp1.h5`), `ref.h5` and `new.h5` (the same few steps, the second run's
  weights nudged), `stats.h5` (statistics mode), and `mypkg/models.py` whose `build()`
  returns the model (for `vartrace sites`).  A file the snippet saves to
  (`H5PYSaverCallback("run.h5")`) is left out, as on a reader's first run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(\s*)```(\w+)\s*$")
_SKIP = re.compile(r"<!--\s*snippet:\s*skip\s*\((.+)\)\s*-->")
_WRITES = re.compile(r"H5PYSaverCallback\(\s*\"([^\"]+)\"")
_VOCAB, _SEQ, _WIDTH = 16, 8, 16


@dataclass
class Snippet:
    page: str
    line: int
    language: str
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _snippets() -> list[Snippet]:
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        index = 0
        while index < len(lines):
            match = _FENCE.match(lines[index])
            if not match or match.group(2) not in ("python", "bash"):
                index += 1
                continue
            indent, end = len(match.group(1)), index + 1
            while lines[end].strip() != "```":
                end += 1
            before = [line for line in lines[:index] if line.strip()][-1:]
            skip = _SKIP.search(before[0]) if before else None
            code = "\n".join(line[indent:] for line in lines[index + 1 : end])
            found.append(
                Snippet(
                    page=page.relative_to(ROOT).as_posix(),
                    line=index + 1,
                    language=match.group(2),
                    code=code,
                    skip=skip.group(1) if skip else None,
                )
            )
            index = end + 1
    return found


# What a snippet uses that an optional extra installs: the marker in its text, the module.
_EXTRAS = {
    "tensorboard": "tensorboard",
    "TensorBoard": "tensorboard",
    "to_xarray": "xarray",
    "import xarray": "xarray",
    "h5netcdf": "h5netcdf",
    '"blosc': "hdf5plugin",
    "hdf5plugin": "hdf5plugin",
    "scheduler=": "dask",
    "to_dask": "dask",
    "memory://": "fsspec",
    "storage_options": "fsspec",
}


def _missing_extras(code: str) -> list[str]:
    """The optional packages a snippet needs that this environment lacks (CI's 3.12 job
    installs the test extra only)."""
    wanted = {module for marker, module in _EXTRAS.items() if marker in code}
    return sorted(m for m in wanted if importlib.util.find_spec(m) is None)


def _commands(code: str) -> list[list[str]]:
    """The `vartrace ...` command lines of a bash snippet, without their comments."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():  # a trailing \\ continues
        words = shlex.split(line, comments=True)
        if words and words[0] in ("vartrace", ".venv/bin/vartrace"):
            commands.append(words[1:])
    return commands


SNIPPETS = [s for s in _snippets() if s.language == "python" or _commands(s.code)]


# -- the prelude ------------------------------------------------------------------------------


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(_WIDTH, 3 * _WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / _WIDTH**0.5
        return scores.softmax(dim=-1) @ v


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(_WIDTH, 2 * _WIDTH), nn.Linear(2 * _WIDTH, _WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        return self.down(h)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, _WIDTH)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(_WIDTH, _VOCAB)

    def forward(self, tokens: torch.Tensor) -> Output:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flip(1).flatten())
        return Output(logits, loss)


def build() -> TinyGPT:
    """The prelude's model, seeded: the same weights every time."""
    torch.manual_seed(0)
    return TinyGPT()


def prelude() -> dict[str, Any]:
    """A fresh namespace holding what the pages take as given."""
    model = build()
    generator = torch.Generator().manual_seed(1)
    loader = [torch.randint(0, _VOCAB, (4, _SEQ), generator=generator) for _ in range(4)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(model: nn.Module) -> None:
        for batch in loader:
            optimizer.zero_grad()
            model(batch).loss.backward()
            optimizer.step()

    return {
        "__name__": "__snippet__",
        "torch": torch,
        "nn": nn,
        "vartrace": vartrace,
        "ModelTracer": ModelTracer,
        "H5PYSaverCallback": H5PYSaverCallback,
        "model": model,
        "loader": loader,
        "optimizer": optimizer,
        "train": train,
        "paths": ["layers.*.attn.forward.scores"],
    }


def _trace_run(path: Path, steps: int, nudge: float = 0.0, statistics: bool = False) -> None:
    names = prelude()
    model, loader, optimizer = names["model"], names["loader"], names["optimizer"]
    with torch.no_grad():
        model.layers[0].attn.qkv.bias.add_(nudge)
    sites = ["forward.tokens", "layers.*.attn.forward.scores", "layers.*.mlp.forward.h"]
    if statistics:
        sites = ["layers.*.forward", "layers.*.attn.forward.scores"]
    with (
        H5PYSaverCallback(path) as saver,
        ModelTracer(
            model,
            sites,
            post_gather_callbacks=[saver],
            gathering_interval=50,
            statistics=statistics,
        ),
    ):
        for step in range(steps):
            optimizer.zero_grad()
            loss = model(loader[step % len(loader)]).loss
            vartrace.record("loss", loss)
            loss.backward()
            optimizer.step()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The prelude's files, made once by real runs of the prelude's model."""
    folder = tmp_path_factory.mktemp("prelude")
    _trace_run(folder / "run.h5", steps=300)
    for copy in ("attn.h5", "exp1.h5"):
        shutil.copy(folder / "run.h5", folder / copy)
    _trace_run(folder / "ref.h5", steps=8)
    _trace_run(folder / "new.h5", steps=8, nudge=1e-3)
    _trace_run(folder / "stats.h5", steps=8, statistics=True)
    (folder / "mypkg").mkdir()
    (folder / "mypkg" / "models.py").write_text(
        "from tests.docs.test_doc_snippets import build\n\n__all__ = ['build']\n"
    )
    return folder


# -- the snippets -----------------------------------------------------------------------------


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs_as_written(
    snippet: Snippet, files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if snippet.skip:
        pytest.skip(f"{snippet.id}: {snippet.skip}")
    missing = _missing_extras(snippet.code)
    if missing:
        pytest.skip(f"{snippet.id}: needs {', '.join(missing)}, not installed (an optional extra)")
    written = set(_WRITES.findall(snippet.code))  # a saver refuses a file that exists
    shutil.copytree(files, tmp_path, dirs_exist_ok=True, ignore=lambda _, names: written)
    monkeypatch.chdir(tmp_path)
    if snippet.language == "python":
        exec(compile(snippet.code, snippet.id, "exec"), prelude())
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    for command in _commands(snippet.code):
        result = subprocess.run(
            [sys.executable, "-m", "vartrace", *command],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        allowed = (0, 1) if command[0] == "compare" else (0,)  # compare: 1 when runs differ
        assert result.returncode in allowed, f"vartrace {shlex.join(command)}\n{result.stderr}"
        assert "Traceback" not in result.stderr, result.stderr


def test_the_pages_hold_snippets_and_say_why_one_is_skipped() -> None:
    assert len([s for s in SNIPPETS if s.language == "python"]) >= 20
    for snippet in SNIPPETS:
        assert snippet.skip is None or snippet.skip.strip(), snippet.id
