"""`vartrace.staging.dense`: each site's last record, plain dense CPU copies compared bit
for bit by their bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import vartrace.staging.dense
from tests._env import run_without_a_compiler
from vartrace._support import memory, native
from vartrace.staging.dense import COPIED_AS_BYTES, DenseCopy, LastRecords, plain_copy
from vartrace.tensors import dense_clone, same


def _differs(last: LastRecords, site: str, value: torch.Tensor) -> bool:
    """Whether `site` keeps `value` (a copy of it) as a new record."""
    record = last.dense_copy(site, value, value.nbytes)
    if record is not None:
        assert same(record, value.resolve_neg()) and record.is_contiguous()
        assert not value.nbytes or record.data_ptr() != value.data_ptr()
    return record is not None


def test_a_plain_record_is_kept_as_its_bytes_and_a_complex_one_as_it_is() -> None:
    last = LastRecords()
    assert _differs(last, "real", torch.arange(6.0).reshape(2, 3))
    assert _differs(last, "complex", torch.ones(3, dtype=torch.complex64))
    assert type(last._last["real"]) is DenseCopy
    assert type(last._last["complex"]) is torch.Tensor


def test_records_differ_as_same_says_bit_for_bit_on_either_path() -> None:
    nan, other_nan = torch.tensor([float("nan")]), torch.tensor([float("nan")])
    other_nan.view(torch.int32).add_(1)  # another NaN payload
    pairs = [
        (torch.zeros(4), torch.zeros(4)),
        (torch.zeros(4), torch.tensor([0.0, 0.0, 0.0, -0.0])),
        (nan, nan.clone()),
        (nan, other_nan),
        (torch.zeros(4), torch.zeros(2, 2)),  # the same bytes in another shape
        (torch.zeros(4), torch.zeros(4, dtype=torch.int32)),  # ... of another dtype
        (torch.zeros(0), torch.zeros(0)),
        (torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool)),
    ]
    for a, b in pairs:
        verdict = not same(a, b)
        for first, second in [("dense", "dense"), ("dense", "host"), ("host", "dense")]:
            last = LastRecords()
            for path, record in ((first, a), (second, b)):
                differs = (
                    _differs(last, "site", record)
                    if path == "dense"
                    else last.differs("site", record)
                )
            assert differs is verdict, (a, b, first, second)


def test_the_compiled_comparison_replaces_ctypes_where_it_can_be_built() -> None:
    LastRecords()  # builds it
    built = native.load(Path(memory.__file__).with_name("bytes.c"), "vartrace_bytes")
    if built is not None:  # (no compiler here: ctypes' memcmp stays)
        assert memory.memcmp is built.memcmp
    a, b = torch.arange(1000.0), torch.arange(1000.0)
    assert memory.memcmp is not None
    assert memory.memcmp(a.data_ptr(), b.data_ptr(), a.nbytes) == 0
    b[999] = -1.0
    assert memory.memcmp(a.data_ptr(), b.data_ptr(), a.nbytes) != 0
    assert memory.memcmp(a.data_ptr(), b.data_ptr(), 999 * 4) == 0


@pytest.mark.parametrize("nbytes", [0, 1, 127, 128, 129, 4096 + 37, 3 << 20])
def test_the_compiled_copy_copies_exactly_the_bytes_asked_for(nbytes: int) -> None:
    memory.build_memcmp()
    if memory.memcpy is None:
        pytest.skip("no compiler here: records are copied by torch")
    source = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8)
    destination = torch.zeros(nbytes + 64, dtype=torch.uint8)
    memory.memcpy(destination.data_ptr() + 32, source.data_ptr() + 32, nbytes)
    assert torch.equal(destination[32 : 32 + nbytes], source[32 : 32 + nbytes])
    assert not destination[:32].any() and not destination[32 + nbytes :].any()


@pytest.mark.parametrize("compared", [True, False], ids=["compared", "not-compared"])
@pytest.mark.parametrize("dtype", sorted(COPIED_AS_BYTES, key=str))
def test_a_record_copied_as_its_bytes_is_an_independent_plain_copy(
    dtype: torch.dtype, compared: bool
) -> None:
    last = LastRecords()
    weight = torch.ones(5, 7, requires_grad=dtype.is_floating_point and dtype.itemsize > 1)
    value = (weight * 3).to(dtype)[1:]  # a view past its storage's start, maybe in autograd
    if not compared:  # change_detection=False
        value = torch._neg_view(value) if dtype == torch.float32 else value  # not its bytes
        record = plain_copy(value, value.nbytes)
        assert torch.equal(record, value.detach()) and not record.is_neg()
        assert not record.requires_grad and record.data_ptr() != value.data_ptr()
        return
    record = last.dense_copy("site", value, value.nbytes)
    assert record is not None and type(record) is torch.Tensor
    assert record.dtype == dtype and record.shape == value.shape and record.is_contiguous()
    assert not record.requires_grad and record.grad_fn is None
    assert torch.equal(record.view(torch.uint8), value.detach().view(torch.uint8))
    with torch.no_grad():
        value.zero_()  # the step writes on: the record keeps what was captured
    assert record.view(torch.uint8).any()
    assert last.dense_copy("site", value, value.nbytes) is not None


def test_a_last_record_resized_in_place_is_compared_as_it_is_now() -> None:
    last = LastRecords()
    record = last.dense_copy("site", torch.ones(4), 16)
    assert record is not None
    record.resize_(1 << 16)  # a callback's resize_: the bytes move
    record.fill_(1.0)
    assert _differs(last, "site", torch.ones(4))  # its shape now differs
    assert not _differs(last, "site", torch.ones(4))
    kept = last._last["site"].tensor
    kept.resize_(1 << 16)
    kept.resize_(4)  # back to the shape of the key, in a new storage
    kept.fill_(1.0)
    assert not _differs(last, "site", torch.ones(4))
    assert not _differs(last, "site", torch.ones(4))  # (repeated: compared before a copy)
    kept.resize_(1 << 16)
    kept.fill_(2.0)
    kept.resize_(4)
    assert _differs(last, "site", torch.ones(4))


def test_a_record_compared_on_the_device_forgets_the_host_s_last_one() -> None:
    last = LastRecords()
    assert _differs(last, "site", torch.ones(4))
    assert last.differs("site", None)
    assert _differs(last, "site", torch.ones(4))  # nothing to compare it with


def test_a_value_that_repeated_is_compared_before_it_is_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copies: list[torch.Tensor] = []

    def counted(copy: Any) -> Any:
        def counted_copy(value: torch.Tensor) -> torch.Tensor:
            copies.append(value)
            return copy(value)  # type: ignore[no-any-return]

        return counted_copy

    # Copied by torch, or into a tensor made for the copy of its bytes.
    monkeypatch.setattr(vartrace.staging.dense, "dense_clone", counted(dense_clone))
    monkeypatch.setattr(vartrace.staging.dense, "_empty_like", counted(torch.empty_like))
    last = LastRecords()
    ones, zeros = torch.ones(2, 3), torch.zeros(2, 3)
    verdicts = [_differs(last, "site", value) for value in [ones, ones, ones, ones]]
    assert verdicts == [True, False, False, False]
    assert len(copies) == 2  # the first record, and the first repeat, compared by its copy
    assert _differs(last, "site", zeros)  # compared as it lies: it differs, then copied
    assert len(copies) == 3
    assert [_differs(last, "site", zeros) for _ in range(3)] == [False, False, False]
    assert len(copies) == 4  # a new record: compared by its copy until it repeats
    # A value not contiguous, or whose bytes are not its values, is compared by its copy.
    assert not _differs(last, "site", torch.zeros(3, 2).t())
    assert not _differs(last, "site", torch._efficientzerotensor(2, 3))  # no bytes at all
    negated = torch._neg_view(torch.zeros(2, 3))  # the bytes of +0.0, the values -0.0
    assert negated.is_contiguous() and negated.data_ptr()
    assert _differs(last, "site", negated)
    assert len(copies) == 7
    minus = torch.full((2, 3), -0.0)
    assert not _differs(last, "site", minus)
    assert not _differs(last, "site", minus)
    assert len(copies) == 8
    # The bytes of +0.0 as they lie, in a view whose values are -0.0 as the last record's.
    assert not _differs(last, "site", torch._neg_view(torch.zeros(2, 3)))
    assert len(copies) == 9
    assert not _differs(last, "site", minus)
    assert len(copies) == 9


WITHOUT_A_COMPILER = """
import torch
from torch import nn
import vartrace
from vartrace._support import memory

class Block(nn.Module):
    def forward(self, x):
        y = x * 1
        return y

block = Block()
with vartrace.ModelTracer(block, ["forward.y"]) as tracer:
    for x in [torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3)]:
        block(x)
print(type(memory.memcmp).__module__, tracer.results["forward.y"].iterations)
"""


def test_without_a_compiler_change_detection_calls_the_c_library_through_ctypes(
    tmp_path: Path,
) -> None:
    output = run_without_a_compiler(WITHOUT_A_COMPILER, tmp_path)
    assert output.split(maxsplit=1) == ["ctypes", "[1, 3, 5]\n"]
