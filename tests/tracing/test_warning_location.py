"""vartrace's warnings name the user's line, not vartrace's (or torch's) file.

On Python 3.12+ ``vartrace._support.warnings.warn`` uses ``skip_file_prefixes``; before, a
``stacklevel`` computed by walking the stack.  The tests hold on both.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

import vartrace
from vartrace import ModelTracer
from vartrace._support.warnings import warn

THIS_FILE = str(Path(__file__).resolve())
PACKAGE = str(Path(vartrace.__file__).resolve().parent)


class Holder:
    """An object holding a tensor: recorded as its tensors, with a warning."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Inner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = Holder(x * 2)
        return x + held.tensor


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # the user's line of an in-step warning about inner's site


def _line_of(text: str) -> int:
    """The line number of the first line of this file containing ``text``."""
    lines = Path(__file__).read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)


def _only(caught: list[warnings.WarningMessage], words: str) -> warnings.WarningMessage:
    matching = [w for w in caught if words in str(w.message)]
    assert len(matching) == 1, [str(w.message) for w in caught]
    return matching[0]


def test_a_pattern_matching_nothing_names_the_line_that_built_the_tracer() -> None:
    model = Outer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelTracer(model, ["nowhere.forward.x"], strict=False)  # the warned line
    found = _only(caught, "matches no site")
    assert found.filename == THIS_FILE
    assert found.lineno == _line_of("# the warned line")


def test_a_warning_inside_the_step_names_the_users_call_not_torch_or_vartrace() -> None:
    model = Outer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(model, ["inner.forward.held"]):
            model(torch.ones(2))
    found = _only(caught, "holding tensors")
    assert found.filename == THIS_FILE
    assert found.lineno == _line_of("# the user's line of an in-step warning")


def test_a_warning_kept_under_an_error_filter_is_released_at_the_users_line() -> None:
    """A warning an error filter raised inside the step is kept (the step goes on) and
    emitted again at ``stop()``: then attributed to the line that called ``stop()``."""
    model = Outer()
    tracer = ModelTracer(model, ["inner.forward.held"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")
        tracer.start()
        model(torch.ones(2))  # the warning is raised by the filter, and kept
        assert caught == []
        warnings.simplefilter("always")
        tracer.stop()  # the released line
    found = _only(caught, "holding tensors")
    assert found.filename == THIS_FILE
    assert found.lineno == _line_of("# the released line")
    assert tracer.results["inner.forward.held.tensor"].records()[0].tolist() == [2.0, 2.0]


def test_warn_called_from_outside_vartrace_names_its_caller() -> None:
    """A call from the user's own code (no vartrace frame in between) is its own line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("vartrace: a note", RuntimeWarning)  # the direct call
    (found,) = caught
    assert found.filename == THIS_FILE
    assert found.lineno == _line_of("# the direct call")
    assert not found.filename.startswith(PACKAGE)
