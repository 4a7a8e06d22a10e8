"""Nested tensors, tensor subclasses that implement a few ops, containers that refuse to be
listed: reduced, recorded or a marker, never an exception in the step they watch.

Each test traces a real module that builds the value inside its ``forward``; where the
item concerns storage, the records go through a real HDF5 file read back with
``vartrace.open``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer
from vartrace.tensors import failed_copy, failed_reduction

NESTED_PROTOTYPE = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
LAYOUTS = [pytest.param(torch.strided, id="strided"), pytest.param(torch.jagged, id="jagged")]


class Nested(nn.Module):
    """Holds a nested tensor of two components, (2, 3) and (3, 3), in `nested`."""

    def __init__(self, layout: torch.layout) -> None:
        super().__init__()
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nested = torch.nested.nested_tensor([x[:2], x[:3]], layout=self.layout)  # noqa: F841
        return x * 2


def _trace(model: nn.Module, path: Path, steps: list[torch.Tensor], **options: Any) -> vartrace.Run:
    """Run `model` on each step's input under a tracer of `forward.*` writing `path`."""
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(model, ["forward.*"], post_gather_callbacks=[saver], **options),
    ):
        for x in steps:
            model(x)
    return vartrace.open(path)


@NESTED_PROTOTYPE
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("extras", [{}, {"histogram": True, "quantiles": (0.5,)}])
def test_statistics_of_a_nested_tensor_are_those_of_its_elements(
    tmp_path: Path, layout: torch.layout, extras: dict[str, Any]
) -> None:
    """`statistics=True` reduces a nested tensor (either layout) over its components'
    elements; its ragged axis reads -1 in what the records were reduced from."""
    steps = [torch.arange(12.0).reshape(4, 3) - step for step in range(2)]
    statistics = vartrace.stats(**extras) if extras else True
    with _trace(Nested(layout), tmp_path / "run.h5", steps, statistics=statistics) as run:
        site = run["forward.nested"]
        assert list(site.iterations) == [1, 2]
        for step, x in enumerate(steps, 1):
            elements = torch.cat([x[:2].reshape(-1), x[:3].reshape(-1)])
            record = site.get(iteration=step)
            assert record["count"] == 15
            assert record["mean"] == pytest.approx(float(elements.mean()))
            assert record["max"] == float(elements.max())
        assert site.reduced_from == vartrace.ReducedFrom("float32", (2, -1, 3))


@NESTED_PROTOTYPE
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("staging", ["sync", "async"])
def test_whole_records_of_a_nested_tensor_never_break_the_step(
    tmp_path: Path, layout: torch.layout, staging: str
) -> None:
    steps = [torch.randn(4, 3) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "vartrace: staging='async'")
        run = _trace(Nested(layout), tmp_path / "run.h5", steps, staging=staging)
    with run:
        for step, x in enumerate(steps, 1):
            record = run["forward.nested"].get(iteration=step)
            assert [part.tolist() for part in record.unbind()] == [x[:2].tolist(), x[:3].tolist()]


@NESTED_PROTOTYPE
def test_a_marker_names_a_nested_tensor_without_reading_its_shape() -> None:
    """A strided nested tensor raises on `.shape`: its marker says what it can tell."""
    nested = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(3, 3)])
    jagged = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(3, 3)], layout=torch.jagged)
    with pytest.warns(RuntimeWarning, match="nested tensor") as caught:
        reduced = failed_reduction(nested, "odd.nested", "vartrace.stats()", RuntimeError("no"))
        copied = failed_copy(nested, "odd.copied", RuntimeError("no"))
        copied_jagged = failed_copy(jagged, "odd.jagged", RuntimeError("no"))
    assert len(caught) == 3
    assert reduced == "torch.float32 nested tensor: cannot reduce it (vartrace.stats(): no)"
    assert copied == "torch.float32 nested tensor: cannot copy it (no)"
    assert copied_jagged.startswith("torch.float32 nested tensor")


class FewOps(torch.Tensor):
    """A wrapper subclass implementing only the ops its model needs (as FP8 and
    quantization libraries do): here `mul`, and whatever `implemented` adds."""

    implemented: ClassVar[frozenset[Any]] = frozenset({torch.ops.aten.mul.Tensor})

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> FewOps:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func not in cls.implemented:
            raise NotImplementedError(f"{cls.__name__} does not implement {func}")

        def unwrap(value: Any) -> Any:
            return value.inner if isinstance(value, FewOps) else value

        return cls(func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


class Copyable(FewOps):
    """Also `detach` and `clone`: its copy is made, and is a `Copyable` too."""

    implemented = FewOps.implemented | {torch.ops.aten.detach.default, torch.ops.aten.clone.default}


class Wraps(nn.Module):
    """Holds `make(x)` in `w`: a value that refuses most of what is done to it."""

    def __init__(self, make: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.make(x)  # noqa: F841 (recorded)
        return x + 1


class RefusesIteration(dict):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        raise RuntimeError("this mapping is not iterable")


class RefusesIterationList(list):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        raise RuntimeError("this list is not iterable")


@pytest.mark.warnings_as_errors
@pytest.mark.parametrize("statistics", [False, True])
@pytest.mark.parametrize("staging", ["sync", "async"])
def test_a_tensor_subclass_without_detach_is_a_marker_never_the_steps_error(
    tmp_path: Path, statistics: bool, staging: str
) -> None:
    """The untraced forward runs; traced, the record is a marker with one warning, also
    under `-W error` (the warning is raised at the stop, after every step ran).  Each case
    records its own site: a site warns once per process."""
    tag = f"{staging}_{statistics}"
    model = Wraps(lambda x: {tag: FewOps(x) * 2})
    model(torch.randn(3))  # untraced: the model itself needs no more ops
    steps = 0
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
    tracer = ModelTracer(
        model, ["forward.w"], post_gather_callbacks=[saver], statistics=statistics, staging=staging
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "vartrace: staging='async'")
        said = rf"site 'forward\.w\.{tag}': cannot (copy|reduce)"
        with pytest.raises(RuntimeWarning, match=said), tracer:
            for _ in range(2):
                model(torch.randn(3))
                steps += 1
    saver.close()
    assert steps == 2
    with vartrace.open(tmp_path / "run.h5") as run:
        marker = run[f"forward.w.{tag}"].get(iteration=1)
        assert isinstance(marker, vartrace.Unstored)
        assert "FewOps does not implement aten.detach" in marker


@pytest.mark.parametrize("staging", ["sync", "async"])
def test_a_copyable_tensor_subclass_is_compared_without_breaking_the_step(staging: str) -> None:
    """Its copy lacks what change detection uses (`data_ptr`, `equal`): each record is
    kept, as a record not known equal to the last."""
    model = Wraps(lambda x: Copyable(x) * 2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "vartrace: staging='async'")
        with ModelTracer(model, ["forward.w"], staging=staging) as tracer:
            for _ in range(3):
                model(torch.ones(3))
    values = tracer.results["forward.w"].values
    assert len(values) == 3 and all(type(value) is Copyable for value in values)


@pytest.mark.warnings_as_errors
@pytest.mark.parametrize("staging", ["sync", "async"])
def test_a_copyable_storage_less_subclass_is_a_marker_in_the_file(
    tmp_path: Path, staging: str
) -> None:
    """The tracer keeps its copies, but a file cannot hold a wrapper with no memory of its
    own: the saver stores a marker with one warning, never an error in the step."""
    model = Wraps(lambda x: Copyable(x) * 2)
    steps = 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with (
            H5PYSaverCallback(tmp_path / "run.h5", metadata=False) as saver,
            ModelTracer(model, ["forward.w"], post_gather_callbacks=[saver], staging=staging),
        ):
            for _ in range(3):
                model(torch.ones(3))
                steps += 1
    assert steps == 3
    said = [str(w.message) for w in seen if "Copyable tensor: cannot store it" in str(w.message)]
    assert len(said) <= 1  # once a class in a process (the first case of the two says it)
    with vartrace.open(tmp_path / "run.h5") as run:
        markers = [run["forward.w"].get(iteration=i) for i in (1, 2, 3)]
    assert all(isinstance(m, vartrace.Unstored) for m in markers), markers
    assert all("Copyable tensor: cannot store it" in m for m in markers)


@pytest.mark.parametrize("refuses", [RefusesIteration, RefusesIterationList])
@pytest.mark.parametrize("statistics", [False, True])
def test_a_container_whose_iteration_raises_is_a_marker(
    tmp_path: Path, refuses: type, statistics: bool
) -> None:
    """Inside an ordinary dict: the rest of the value is recorded as usual.  Each case
    records its own site: a site warns once per process."""
    parts = {"a": 0} if refuses is RefusesIteration else [0]
    odd = f"odd_{refuses.__name__}_{statistics}"

    def make(x: torch.Tensor) -> dict[str, Any]:
        return {odd: refuses(parts), "x": x}

    with pytest.warns(RuntimeWarning, match="cannot list the items of a Refuses"):
        run = _trace(Wraps(make), tmp_path / "run.h5", [torch.ones(3)], statistics=statistics)
    with run:
        marker = run[f"forward.w.{odd}"].get(iteration=1)
        assert isinstance(marker, vartrace.Unstored)
        assert marker == (
            f"{refuses.__qualname__}: cannot list its items (RuntimeError: this "
            f"{'mapping' if refuses is RefusesIteration else 'list'} is not iterable)"
        )
        x = run["forward.w.x"].get(iteration=1)
        assert (x["mean"] == 1.0) if statistics else x.tolist() == [1.0, 1.0, 1.0]


class Holder:
    """A plain object holding a tensor and a container that refuses to be listed."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.odd = RefusesIteration(a=0)


def test_an_object_holding_a_container_whose_iteration_raises_never_breaks_the_step() -> None:
    """Its tensors cannot all be found: the object is recorded as itself (a copy, or a
    marker when the copy fails too)."""
    model = Wraps(Holder)
    with ModelTracer(model, ["forward.w"]) as tracer:
        model(torch.ones(3))
    (record,) = tracer.results["forward.w"].values
    assert isinstance(record, (Holder, vartrace.Unstored))
