"""Values whose copy fails: a marker and one warning per site, never an exception in the step.

A real module builds, inside its traced ``forward``, tensors torch cannot copy
(the sub-byte dtypes, ``quint4x2``) and a 4-byte tensor expanded to 512 GiB;
the tracer records each as a :class:`vartrace.Unstored` marker, and the saver
writes it to a real HDF5 file that reads it back as a marker.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer

SUB_BYTE = [
    name
    for name in (*(f"uint{bits}" for bits in range(1, 8)), *(f"int{bits}" for bits in range(1, 8)))
    if hasattr(torch, name)
]
EXPANDED_ELEMENTS = (512 << 30) // 4  # one float32 seen as 512 GiB
QUANTIZE_DEPRECATED = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")


class Uncopyable(nn.Module):
    """Returns, under keys starting with ``tag``, every kind of value whose copy fails,
    next to one ordinary tensor (``<tag>_x``)."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {
            f"{self.tag}_{name}": torch.zeros(4, dtype=getattr(torch, name)) for name in SUB_BYTE
        }
        if hasattr(torch, "quint4x2"):
            packed = torch.quantize_per_tensor(x, 0.5, 0, torch.quint4x2)
            out[f"{self.tag}_quint4x2"] = packed
        out[f"{self.tag}_expanded"] = torch.ones(1).expand(EXPANDED_ELEMENTS)
        out[f"{self.tag}_x"] = x * 2
        return out


@contextlib.contextmanager
def _recording() -> Iterator[list[warnings.WarningMessage]]:
    """The warnings raised inside, every one kept (also under ``-W error``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _uncopyable_sites(tag: str) -> list[str]:
    names = [*SUB_BYTE, *(["quint4x2"] if hasattr(torch, "quint4x2") else []), "expanded"]
    return [f"forward.{tag}_{name}" for name in names]


def _check_marker(site: str, marker: object) -> None:
    """The marker a site's record holds names what could not be copied and why."""
    assert isinstance(marker, vartrace.Unstored), (site, marker)
    name = site.rsplit("_", 1)[1]
    if name == "expanded":
        assert marker == (
            f"torch.float32 tensor of shape ({EXPANDED_ELEMENTS},): cannot copy it (4 bytes "
            "expanded to 512 GiB; an expanded view is copied up to 1 GiB)"
        )
    else:
        assert marker.startswith(f"torch.{name} tensor of shape (4,): cannot copy it ("), marker


@QUANTIZE_DEPRECATED
def test_a_value_whose_copy_fails_is_a_marker_with_one_warning_per_site() -> None:
    model = Uncopyable("plain")
    with _recording() as caught, ModelTracer(model, ["forward"], change_detection=False) as tracer:
        for step in range(3):
            out = model(torch.full((4,), float(step)))
            assert out["plain_x"].equal(torch.full((4,), 2.0 * step))
    results = tracer.results
    ours = [str(w.message) for w in caught if str(w.message).startswith("vartrace: site")]
    for site in _uncopyable_sites("plain"):
        assert list(results[site].iterations) == [1, 2, 3]
        for marker in results[site].values:
            _check_marker(site, marker)
        named = [message for message in ours if message.startswith(f"vartrace: site {site!r}:")]
        assert len(named) == 1, (site, ours)
        assert "cannot copy a torch." in named[0]
    assert results["forward.plain_x"].values[2].equal(torch.full((4,), 4.0))


def test_a_small_expanded_view_is_copied_whole() -> None:
    model = nn.Identity()
    row = torch.arange(3.0)
    with ModelTracer(model, ["forward"]) as tracer:
        model(row.expand(4, 3))
    record = tracer.results["forward"].values[0]
    assert record.shape == (4, 3) and record.stride() == (3, 1)
    assert record.equal(row.expand(4, 3))


class EveryStep(nn.Module):
    """Binds ``h`` in turn to an uncopyable tensor, a huge expanded view and an ordinary one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(4, dtype=torch.uint8)
        if hasattr(torch, "uint4"):
            h = torch.zeros(4, dtype=torch.uint4)
        h = torch.ones(1).expand(EXPANDED_ELEMENTS)
        h = x * 2
        return h


def test_a_line_by_line_value_whose_copy_fails_is_a_marker() -> None:
    model = EveryStep()
    with _recording(), ModelTracer(model, ["forward.h@every"]) as tracer:
        assert model(torch.ones(2)).equal(torch.full((2,), 2.0))
    lines, first = inspect.getsourcelines(EveryStep.forward)

    def bound_at(statement: str) -> list[object]:
        """The records of `h` under the line of `EveryStep.forward` starting `statement`."""
        (found,) = [first + n for n, text in enumerate(lines) if text.strip().startswith(statement)]
        return tracer.results[f"forward.h@every:L{found}"].values

    (uncopyable,) = bound_at("h = torch.zeros(4, dtype=torch.uint4)")
    (expanded,) = bound_at("h = torch.ones(1).expand(")
    (doubled,) = bound_at("h = x * 2")
    assert [type(value) for value in (uncopyable, expanded, doubled)] == [
        vartrace.Unstored,
        vartrace.Unstored,
        torch.Tensor,
    ]
    assert "4 bytes expanded to 512 GiB" in expanded


@QUANTIZE_DEPRECATED
def test_the_saver_writes_the_markers_and_the_file_reads_them_back(tmp_path: Path) -> None:
    model = Uncopyable("saved")
    path = tmp_path / "run.h5"
    with (
        _recording(),
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(model, ["forward"], post_gather_callbacks=[saver], change_detection=False),
    ):
        for step in range(2):
            model(torch.full((4,), float(step)))
    with vartrace.open(path) as run:
        for site in _uncopyable_sites("saved"):
            assert run[site].iterations.tolist() == [1, 2]
            _check_marker(site, run[site].get(iteration=2))
        assert run["forward.saved_x"].get(iteration=2).equal(torch.full((4,), 2.0))


@pytest.mark.warnings_as_errors
@QUANTIZE_DEPRECATED
def test_under_warnings_as_errors_the_steps_run_and_the_warning_comes_at_exit() -> None:
    model = Uncopyable("strict")
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor")
        tracer = ModelTracer(model, ["forward"], change_detection=False)
        with pytest.raises(RuntimeWarning, match=r"vartrace: site 'forward\.strict_"), tracer:
            for step in range(3):
                model(torch.full((4,), float(step)))
                steps += 1
    assert steps == 3
    for site in _uncopyable_sites("strict"):
        assert list(tracer.results[site].iterations) == [1, 2, 3]
        _check_marker(site, tracer.results[site].values[0])


# -- records the built-in statistics reducer cannot reduce -----------------------------------


class Packs(nn.Module):
    """Holds a packed sub-byte tensor (torch can neither copy nor reduce one) beside x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = torch.zeros(4, dtype=getattr(torch, SUB_BYTE[0]))  # noqa: F841 (recorded)
        return x * 2


@pytest.mark.skipif(not SUB_BYTE, reason="this torch has no sub-byte dtypes")
def test_a_record_vartrace_stats_cannot_reduce_becomes_a_marker_in_the_file(tmp_path) -> None:
    """The built-in reducer never raises (a user's callback would, as a CallbackError)."""
    model = Packs()
    sites = ["forward.packed", "forward.x"]
    with (
        pytest.warns(RuntimeWarning, match=r"site 'forward\.packed': cannot reduce a torch\."),
        H5PYSaverCallback(tmp_path / "run.h5", metadata=False) as saver,
        ModelTracer(
            model,
            sites,
            pre_save_callbacks=[vartrace.stats()],
            post_gather_callbacks=[saver],
            change_detection=False,
        ),
    ):
        for step in range(2):
            model(torch.full((3,), float(step)))
    with vartrace.open(tmp_path / "run.h5") as run:
        marker = run["forward.packed"].get(iteration=2)
        assert isinstance(marker, vartrace.Unstored)
        assert marker.startswith(f"torch.{SUB_BYTE[0]} tensor of shape (4,): cannot reduce it")
        assert "vartrace.stats()" in marker
        assert run["forward.x"].get(iteration=2)["mean"] == 1.0


class Nibbles(nn.Module):
    """Packs under another site name: a site warns once per process."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nibbles = torch.zeros(4, dtype=getattr(torch, SUB_BYTE[0]))  # noqa: F841 (recorded)
        return x * 2


@pytest.mark.warnings_as_errors
@pytest.mark.skipif(not SUB_BYTE, reason="this torch has no sub-byte dtypes")
def test_under_warnings_as_errors_a_record_stats_cannot_reduce_breaks_no_step() -> None:
    model = Nibbles()
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tracer = ModelTracer(
            model,
            ["forward.nibbles"],
            pre_save_callbacks=[vartrace.stats()],
            change_detection=False,
        )
        with pytest.raises(RuntimeWarning, match=r"cannot reduce a torch\."), tracer:
            for step in range(3):
                model(torch.full((3,), float(step)))
                steps += 1
    assert steps == 3
    values = tracer.results["forward.nibbles"].values
    assert len(values) == 3 and all(isinstance(v, vartrace.Unstored) for v in values)


class _Wrapped(nn.Module):
    """Builds, in its ``forward``, a tensor subclass that wraps two tensors and has no
    storage of its own (``data_ptr()`` is 0), both as a local and line by line."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
        pair = two_tensor.TwoTensor(x * 2, x * 3)
        return x + pair.a


def test_a_tensor_subclass_without_storage_is_a_marker_never_a_crash(tmp_path: Path) -> None:
    """Change detection once read such a record's bytes at address 0 (SIGSEGV at the
    site's second record) and the saver called ``.numpy()`` on it (an error in the step)."""
    model = _Wrapped()
    path = tmp_path / "wrapped.h5"
    with (
        _recording() as caught,
        H5PYSaverCallback(path) as saver,
        ModelTracer(model, ["forward.pair", "forward.pair@every"], post_gather_callbacks=[saver]),
    ):
        for step in range(3):
            model(torch.full((3,), float(step)))
    run = vartrace.open(path)
    for site in ("forward.pair", *(name for name in run.names if "@every" in name)):
        values = [run[site].get(step) for step in (1, 2, 3)]
        assert all(isinstance(value, vartrace.Unstored) for value in values), values
        assert "TwoTensor of shape (3,): cannot copy it (a tensor subclass" in str(values[0])
    assert sum("TwoTensor" in str(w.message) for w in caught) >= 1


def test_a_tensor_inside_a_torch_func_transform_is_copied_not_marked() -> None:
    """The copy of a plain CPU tensor detaches it with `.data`, which torch.func refuses:
    a tensor that `vmap` wraps (its type is still `torch.Tensor`) takes `detach()`."""
    from vartrace.tensors import copy_leaf

    copies: list[object] = []

    def scaled(x: torch.Tensor) -> torch.Tensor:
        copies.append(copy_leaf(x * 2, torch.device("cpu"), "scaled"))
        return x

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.func.vmap(scaled)(torch.ones(3, 2))
    assert isinstance(copies[0], torch.Tensor)
    assert not isinstance(copies[0], vartrace.Unstored)
