"""The running tracers: a second tracer started on modules another running tracer patches
warns, naming it; `vartrace.active_tracers()` lists them and `vartrace.stop_all()` stops
them; a running tracer nothing of the user's holds is named at exit; a tracer's repr.
The notebook case (a cell run twice) runs in a real Jupyter kernel."""

from __future__ import annotations

import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import vartrace
from tests._env import ROOT, child_env, run_script
from tests._models import TinyTransformer, tokens


@pytest.fixture(autouse=True)
def _none_left_running() -> Iterator[None]:
    yield
    vartrace.stop_all()


def test_a_second_tracer_on_the_same_modules_warns_naming_the_first() -> None:
    model = TinyTransformer()
    first = vartrace.ModelTracer(model, ["layers.*.attn.forward.scores"]).start()
    with pytest.warns(UserWarning, match="1 running tracer") as caught:
        second = vartrace.ModelTracer(model, ["layers.*.attn.forward.scores"]).start()
    message = str(caught[0].message)
    assert repr(first) in message and "started at" in message and __file__ in message
    assert "vartrace.stop_all()" in message and "vartrace.active_tracers()" in message
    assert vartrace.active_tracers() == [first, second]
    second.stop()
    assert vartrace.active_tracers() == [first]


def test_tracers_on_other_models_start_quietly() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = vartrace.ModelTracer(TinyTransformer(), ["forward.x"]).start()
        two = vartrace.ModelTracer(TinyTransformer(), ["forward.x"]).start()
    assert vartrace.active_tracers() == [one, two]


def test_stop_all_stops_every_tracer_and_restores_the_model(tmp_path: Path) -> None:
    model = TinyTransformer()
    saver = vartrace.H5PYSaverCallback(tmp_path / "run.h5")
    first = vartrace.ModelTracer(model, ["head.forward.input"], post_gather_callbacks=[saver])
    first.start()
    with pytest.warns(UserWarning, match="already patch"):
        second = vartrace.ModelTracer(model, ["head.forward.input"]).start()
    model(tokens(0))
    assert vars(model.head).get("forward") is not None  # patched
    assert vartrace.stop_all() == [second, first]
    saver.close()
    assert vartrace.active_tracers() == []
    assert "forward" not in vars(model.head)  # restored
    assert repr(first).startswith("<ModelTracer stopped on TinyTransformer: 1 traced method")
    with vartrace.open(tmp_path / "run.h5") as run:
        assert run["head.forward.input"].iterations.tolist() == [1]


def test_repr_says_state_methods_records_and_where() -> None:
    model = TinyTransformer()
    tracer = vartrace.ModelTracer(model, ["layers.*.attn.forward.scores"])
    assert repr(tracer) == (
        "<ModelTracer not started on TinyTransformer: 2 traced methods, 0 records, 0 bytes held>"
    )
    with tracer:
        model(tokens(0))
        model(tokens(1))
        text = repr(tracer)
    assert text.startswith("<ModelTracer running on TinyTransformer: 2 traced methods, 4 records")
    assert f"started at {__file__}:" in text
    page = tracer._repr_html_()
    assert "<td>layers.0.attn.forward</td>" in page and "<li>state: stopped</li>" in page


def test_a_running_tracer_nobody_holds_is_named_at_exit() -> None:
    done = run_script(
        textwrap.dedent(
            """
            import vartrace
            from tests._models import TinyTransformer, tokens
            model = TinyTransformer()
            kept = vartrace.ModelTracer(TinyTransformer(), ["forward.x"]).start()
            tracer = vartrace.ModelTracer(model, ["head.forward.input"]).start()  # line 6
            tracer = vartrace.ModelTracer(model, ["head.forward.input"]).start()
            model(tokens(0))
            """
        ),
        flags=["-W", "ignore::UserWarning"],
    )
    lost = [line for line in done.stderr.splitlines() if "still running at exit" in line]
    assert len(lost) == 1, done.stderr
    assert "<string>:6>" in lost[0] and "1 records" in lost[0]
    assert "vartrace.stop_all()" in lost[0]


def _cell_text(cell: Any) -> str:
    """The text a notebook cell printed: its streams, and its results' plain text."""
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif "data" in output:
            parts.append(output.data.get("text/plain", ""))
    return "".join(parts)


def test_a_cell_that_starts_a_tracer_run_twice_in_a_jupyter_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])
    start = 'tracer = vartrace.ModelTracer(model, ["layers.*.attn.forward.scores"])\ntracer.start()'
    cells = [
        "import vartrace\nfrom tests._models import TinyTransformer, tokens\n"
        "model = TinyTransformer()",
        start,
        start,  # the same cell, run again
        "model(tokens(0))\nvartrace.active_tracers()",
        "tracer",
        "patched = vars(model.layers[0].attn)\n"
        "len(vartrace.stop_all()), vartrace.active_tracers(), 'forward' in patched",
        f"path = {str(tmp_path / 'nb.h5')!r}\n"
        "with vartrace.H5PYSaverCallback(path) as saver, vartrace.ModelTracer(\n"
        "        model, ['head.forward.input'], post_gather_callbacks=[saver]):\n"
        "    model(tokens(0))\n"
        "run = vartrace.open(path)\nrun",
        "run['head.forward.input']",
        "vartrace.compare(path, path)",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    outputs = [_cell_text(cell) for cell in notebook.cells]
    assert "already patch" not in outputs[1]
    assert "1 running tracer(s) already patch" in outputs[2]
    assert "<ModelTracer running on TinyTransformer: 2 traced methods" in outputs[2]
    listed = outputs[3]
    assert listed.count("<ModelTracer running on TinyTransformer") == 2, listed
    assert listed.count("2 records") == 2  # both recorded the call
    html = [o.data["text/html"] for o in notebook.cells[4].outputs if "data" in o]
    assert html and "<strong>ModelTracer on TinyTransformer</strong>" in html[0]
    assert "<td>layers.1.attn.forward</td>" in html[0]
    assert outputs[5] == "(2, [], False)"
    shown = [
        next(o.data["text/html"] for o in cell.outputs if "data" in o)
        for cell in notebook.cells[6:]
    ]
    assert "<strong>Run " in shown[0] and "<td>head.forward.input</td><td>1</td>" in shown[0]
    assert "<strong>Site head.forward.input</strong>" in shown[1]
    assert "<th>min cosine</th>" in shown[2] and "first divergence: none" in shown[2]


def test_stop_all_stops_the_others_when_one_fails() -> None:
    def broken(name: str, trace: Any) -> None:
        raise OSError("disk gone")

    model = TinyTransformer()
    failing = vartrace.ModelTracer(model, ["head.forward.input"], post_trace_callbacks=[broken])
    failing.start()
    other = vartrace.ModelTracer(TinyTransformer(), ["forward.x"]).start()
    model(tokens(0))
    with pytest.raises(vartrace.CallbackError, match="disk gone"):
        vartrace.stop_all()
    assert vartrace.active_tracers() == []
    assert repr(other).startswith("<ModelTracer stopped")


def test_the_documented_filter_silences_two_tracers_on_purpose() -> None:
    model = TinyTransformer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "vartrace: .* running tracer")
        with vartrace.ModelTracer(model, ["head"]), vartrace.ModelTracer(model, ["head"]):
            model(tokens(0))
