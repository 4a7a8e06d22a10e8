"""Values a traced step may hold that vartrace used to break on, lose or store inexactly.

Each test traces a real module, streams into a real HDF5 file where the item
concerns storage, and reads it back with ``vartrace.open``.
"""

from __future__ import annotations

import inspect
import math
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer, Trace, stack_padded_tensors, stack_tensors
from vartrace.trace import RunContext


class Echo(nn.Module):
    """Returns what it is given: every value a test feeds becomes the return value's record."""

    def forward(self, value: Any) -> Any:
        return value


def _trace_to_file(path: Path, values: list[Any], pattern: str = "forward") -> vartrace.Run:
    """Feed ``values`` (one per step) through a traced Echo into ``path``; open the file."""
    model = Echo()
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(model, [pattern], post_gather_callbacks=[saver], change_detection=False),
    ):
        for value in values:
            assert model(value) is value
    return vartrace.open(path)


def _float_bits(value: float) -> bytes:
    return struct.pack("<d", value)


# -- sparse and meta tensors -------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_and_meta_tensors_are_recorded_without_breaking_the_step(tmp_path: Path) -> None:
    dense = torch.tensor([[0.0, 0.0, 1.5], [float("nan"), 0.0, -2.0]])
    coo, csr = dense.to_sparse(), dense.to_sparse_csr()
    meta = torch.empty(3, 4, dtype=torch.bfloat16, device="meta")
    with _trace_to_file(tmp_path / "run.h5", [{"coo": coo, "csr": csr, "meta": meta}]) as run:
        got_coo = run["forward.coo"].get(iteration=1)
        got_csr = run["forward.csr"].get(iteration=1)
        got_meta = run["forward.meta"].get(iteration=1)
    assert got_coo.layout == torch.sparse_coo and got_csr.layout == torch.sparse_csr
    for got in (got_coo, got_csr):
        assert got.to_dense().view(torch.int32).equal(dense.view(torch.int32))
    assert got_meta.is_meta and got_meta.shape == (3, 4) and got_meta.dtype == torch.bfloat16


def test_sparse_change_detection_sees_a_changed_entry() -> None:
    model = Echo()
    first = torch.tensor([[0.0, 1.0]]).to_sparse()
    with ModelTracer(model, ["forward"]) as tracer:
        model(first)
        model(first.clone())  # same values: not recorded again
        model(torch.tensor([[0.0, 2.0]]).to_sparse())
    assert list(tracer.results["forward"].iterations) == [1, 3]


# -- huge ints and lone surrogates -------------------------------------------------------


def test_an_int_beyond_the_decimal_limit_is_stored_exactly(tmp_path: Path) -> None:
    huge = 7**6000  # about 5070 decimal digits: str() of it raises ValueError
    with _trace_to_file(tmp_path / "run.h5", [huge, -huge, 2**64]) as run:
        got = [run["forward"].get(iteration=i) for i in (1, 2, 3)]
    assert got == [huge, -huge, 2**64]


def test_a_site_name_with_a_lone_surrogate_is_stored_with_the_others(tmp_path: Path) -> None:
    odd = os.fsdecode(b"caf\xe9")  # 'caf\udce9': not encodable as UTF-8
    value = {odd: torch.ones(2), "plain": torch.zeros(3)}
    with _trace_to_file(tmp_path / "run.h5", [value]) as run:
        assert sorted(run.names) == sorted(["forward.plain", f"forward.{odd}"])
        assert run[f"forward.{odd}"].get(iteration=1).equal(torch.ones(2))
        assert run["forward.plain"].get(iteration=1).equal(torch.zeros(3))


def test_a_record_that_cannot_be_copied_or_stored_becomes_a_marker_with_a_warning(
    tmp_path: Path,
) -> None:
    generator = (n for n in range(3))  # deepcopy refuses it: marked when captured
    square = lambda n: n * n  # noqa: E731 (copied as itself, but pickle refuses it: marked by the saver)
    value = {"gen": generator, "fn": square, "x": torch.ones(2)}
    with (
        pytest.warns(RuntimeWarning, match=r"site 'forward.gen': cannot copy a generator"),
        pytest.warns(RuntimeWarning, match=r"site 'forward.fn': cannot store a function"),
    ):
        run = _trace_to_file(tmp_path / "run.h5", [value])
    with run:
        copied = run["forward.gen"].get(iteration=1)
        stored = run["forward.fn"].get(iteration=1)
        assert run["forward.x"].get(iteration=1).equal(torch.ones(2))
    assert isinstance(copied, vartrace.Unstored) and isinstance(stored, vartrace.Unstored)
    assert copied.startswith("generator: cannot copy it")
    assert stored.startswith("function: cannot store a function record")


# -- bit-exact change detection ----------------------------------------------------------


def test_change_detection_compares_floats_and_numpy_scalars_bit_for_bit() -> None:
    quiet = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    other = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000002))[0]
    assert math.isnan(quiet) and math.isnan(other)
    steps = [quiet, other, other, 0.0, -0.0, np.float64(0.0), np.float64(-0.0), np.float32(-0.0)]
    model = Echo()
    with ModelTracer(model, ["forward"]) as tracer:
        for value in steps:
            model(value)
    trace = tracer.results["forward"]
    assert list(trace.iterations) == [1, 2, 4, 5, 6, 7, 8]
    floats = [v for v in trace.values if type(v) is float]
    assert [_float_bits(v) for v in floats] == [_float_bits(v) for v in (quiet, other, 0.0, -0.0)]
    assert [type(v) for v in trace.values[4:]] == [np.float64, np.float64, np.float32]


# -- @every and in-place changes ---------------------------------------------------------


class InPlace(nn.Module):
    """Changes its locals in place, without rebinding them or bumping a version counter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(2)
        buf.data[0] = 1.0  # a write through .data: no version bump
        arr = np.zeros(2)
        arr[1] = 5.0
        items = [1]
        items.append(2)
        buf.data[1] = 3.0  # the final value at return
        return x + buf


def test_every_records_values_taken_by_in_place_changes() -> None:
    model = InPlace()
    paths = ["forward.buf@every", "forward.arr@every", "forward.items@every"]
    with ModelTracer(model, paths) as tracer:
        model(torch.ones(2))
    lines, first = inspect.getsourcelines(InPlace.forward)

    def line(statement: str) -> int:
        (found,) = [first + n for n, text in enumerate(lines) if text.strip().startswith(statement)]
        return found

    records = sorted(
        (order, name, value.tolist() if hasattr(value, "tolist") else value)
        for name, trace in tracer.results.items()
        for order, value in zip(trace.order, trace.values, strict=True)
    )
    # Each value under the line that bound or changed it, in the order the lines ran; the
    # append changed the list, whose leaves are recorded as that line left them.
    assert [(name, value) for _, name, value in records] == [
        (f"forward.buf@every:L{line('buf = torch.zeros(2)')}", [0.0, 0.0]),
        (f"forward.buf@every:L{line('buf.data[0] = 1.0')}", [1.0, 0.0]),
        (f"forward.arr@every:L{line('arr = np.zeros(2)')}", [0.0, 0.0]),
        (f"forward.arr@every:L{line('arr[1] = 5.0')}", [0.0, 5.0]),
        (f"forward.items.0@every:L{line('items = [1]')}", 1),
        (f"forward.items.0@every:L{line('items.append(2)')}", 1),
        (f"forward.items.1@every:L{line('items.append(2)')}", 2),
        (f"forward.buf@every:L{line('buf.data[1] = 3.0')}", [1.0, 3.0]),
    ]


# -- ambiguous leaf names ----------------------------------------------------------------


def test_keys_that_would_share_a_site_name_get_distinct_names() -> None:
    model = Echo()
    value = {1: "int one", "1": "str one", "a.b": "dotted", "a": {"b": "nested"}}
    with ModelTracer(model, ["forward"]) as tracer:
        model(value)
    found = {name: tracer.results[name].values for name in tracer.results}
    assert found == {
        "forward.int:1": ["int one"],
        "forward.1": ["str one"],
        "forward.a\\.b": ["dotted"],
        "forward.a.b": ["nested"],
    }


# -- numpy object arrays -----------------------------------------------------------------


def test_a_numpy_object_array_is_copied_deeply() -> None:
    model = Echo()
    array = np.empty(2, dtype=object)
    array[0], array[1] = [1, 2], {"k": 3}
    with ModelTracer(model, ["forward"]) as tracer:
        model(array)
        array[0].append(99)
        array[1]["k"] = -1
    (record,) = tracer.results["forward"].values
    assert record[0] == [1, 2] and record[1] == {"k": 3}


# -- stacking keeps dtypes ---------------------------------------------------------------


@pytest.mark.parametrize("stack", [stack_tensors, stack_padded_tensors])
def test_stacking_keeps_python_numbers_exact(stack: Any) -> None:
    floats = Trace([1e300, -0.0, 0.1], [1, 2, 3], [0, 0, 0], [1, 2, 3])
    stack("f", floats)
    assert floats.values.dtype == torch.float64
    assert floats.values.tolist() == [1e300, -0.0, 0.1]
    ints = Trace([2**40 + 1, -(2**62)], [1, 2], [0, 0], [1, 2])
    stack("i", ints)
    assert ints.values.dtype == torch.int64 and ints.values.tolist() == [2**40 + 1, -(2**62)]


@pytest.mark.parametrize("stack", [stack_tensors, stack_padded_tensors])
def test_stacking_never_converts_a_value(stack: Any) -> None:
    stack.on_start(RunContext())  # a run of its own: no site warned about yet
    mixed = Trace([torch.tensor([2**60 + 1]), torch.tensor([0.5])], [1, 2], [0, 0], [1, 2])
    again = Trace([torch.tensor([0.25]), torch.tensor([2**60 + 3])], [3, 4], [0, 0], [3, 4])
    name = f"m-{stack.__name__}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stack(name, mixed)
        stack(name, again)  # unstackable as well: left a list, and no second warning
        stack("other", Trace([torch.tensor([2**60 + 1]), torch.tensor([0.5])], [1, 2], [0, 0]))
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 2, said  # one warning a site
    assert f"'{name}' unstacked" in said[0] and "dtypes ['float32', 'int64']" in said[0]
    assert "'other' unstacked" in said[1]
    assert isinstance(mixed.values, list) and mixed.values[0].item() == 2**60 + 1
    assert isinstance(again.values, list) and again.values[1].item() == 2**60 + 3
    huge = Trace([2**70], [1], [0], [1])
    name = f"h-{stack.__name__}"
    with pytest.warns(RuntimeWarning, match=rf"'{name}' unstacked.*cannot stack the int 0x4"):
        stack(name, huge)
    assert huge.values == [2**70]


@pytest.mark.parametrize("stack", [stack_tensors, stack_padded_tensors])
def test_each_tracer_warns_once_per_site_about_a_chunk_left_unstacked(stack: Any) -> None:
    """The once-per-site state is the run's: a second tracer warns again, once, for the site."""
    values = [torch.tensor([2**60 + 1]), torch.tensor([0.5])]  # no dtype holds both exactly
    said: list[list[str]] = []
    for _ in range(2):
        model = Echo()
        with (
            warnings.catch_warnings(record=True) as caught,
            ModelTracer(
                model,
                ["forward"],
                post_gather_callbacks=[stack],
                gathering_interval=2,
                change_detection=False,
            ) as tracer,
        ):
            warnings.simplefilter("always")
            for step in range(6):  # three gathers, each left unstacked
                model(values[step % 2])
        said.append([str(w.message) for w in caught if "unstacked" in str(w.message)])
        chunks = tracer.results["forward"]
        assert [value.item() for value in chunks.values] == [2**60 + 1, 0.5] * 3
    assert [len(run) for run in said] == [1, 1], said
    assert f"{stack.__name__} leaves the records of site 'forward' unstacked" in said[1][0]


def test_a_big_endian_array_keeps_its_byte_order_in_the_file(tmp_path: Path) -> None:
    value = {"a": np.arange(3, dtype=">i4"), "s": np.array(5, dtype=">i4"), "f": np.float64(-0.0)}
    value["b"] = np.array([-0.0, 1.5], dtype=">f8")
    with _trace_to_file(tmp_path / "run.h5", [value]) as run:
        got = {key: run[f"forward.{key}"].get(iteration=1) for key in value}
    for key, want in value.items():
        assert type(got[key]) is type(want) and got[key].dtype == want.dtype, key
        assert got[key].tobytes() == want.tobytes(), key
