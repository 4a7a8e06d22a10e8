"""A name `tracer.results` lacks: its KeyError says what is there, as a run file's does.

`@every` stores each value under the line that bound it (`forward.h@every:L<line>`); the
name a pattern was written with is no key but reads them all as one series, which names
its per-line keys.  Real tracers, a real HDF5 file for the run's wording.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer


class Twice(nn.Module):
    """Binds `h` on two lines."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + 1
        h = h * 2
        return h


def _every_keys() -> list[str]:
    """The keys of `Twice.forward`'s `h@every`: one per line binding `h`, in line order."""
    lines, first = inspect.getsourcelines(Twice.forward)
    return [
        f"forward.h@every:L{first + n}"
        for n, text in enumerate(lines)
        if text.strip().startswith("h = ")
    ]


def _traced(path: Path | None = None) -> ModelTracer:
    model = Twice()
    callbacks = [H5PYSaverCallback(path, metadata=False)] if path else []
    with ModelTracer(model, ["forward.h@every"], post_gather_callbacks=callbacks) as tracer:
        model(torch.ones(2))
    for callback in callbacks:
        callback.close()
    return tracer


def test_a_plain_every_name_names_its_per_line_keys() -> None:
    tracer = _traced()
    keys = _every_keys()
    assert sorted(tracer.results) == sorted(keys) and len(keys) == 2
    assert tracer.results["forward.h@every"].sites == keys
    with pytest.raises(KeyError) as caught:
        tracer.results["forward.g@every"]
    message = caught.value.args[0]
    assert message.startswith("no site 'forward.g@every' in the tracer's results; close matches: ")
    assert set(message.split("close matches: ")[1].split(", ")) == {"forward.h@every", *keys}
    assert "forward.h@every" in tracer.results and keys[0] in tracer.results


def test_a_name_like_nothing_there_says_only_that_it_is_missing() -> None:
    tracer = _traced()
    with pytest.raises(KeyError) as caught:
        tracer.results["head.forward.logits"]
    assert caught.value.args[0] == "no site 'head.forward.logits' in the tracer's results"


def test_the_results_and_the_run_file_name_the_same_close_matches(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _traced(path)  # the saver takes the records: the file holds what results would
    with vartrace.open(path) as run, pytest.raises(KeyError) as in_file:
        run["forward.g@every"]
    with pytest.raises(KeyError) as in_memory:
        _traced().results["forward.g@every"]
    place = "the tracer's results"
    assert in_file.value.args[0] == in_memory.value.args[0].replace(place, str(path), 1)
