"""`vartrace.staging.dense`: each site's last record, plain dense CPU copies compared bit
for bit by their bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from vartrace._support import memory, native
from vartrace.staging.dense import DenseCopy, LastRecords
from vartrace.tensors import same


def test_a_plain_record_is_kept_as_its_bytes_and_a_complex_one_as_it_is() -> None:
    last = LastRecords()
    assert last.dense_differs("real", torch.arange(6.0).reshape(2, 3), 24)
    assert last.dense_differs("complex", torch.ones(3, dtype=torch.complex64), 24)
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
                    last.dense_differs("site", record, record.nbytes)
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


def test_a_last_record_resized_in_place_is_compared_as_it_is_now() -> None:
    last = LastRecords()
    record = torch.ones(4)
    assert last.dense_differs("site", record, 16)
    record.resize_(1 << 16)  # a callback's resize_: the bytes move
    record.fill_(1.0)
    assert last.dense_differs("site", torch.ones(4), 16)  # its shape now differs
    assert not last.dense_differs("site", torch.ones(4), 16)
    kept = last._last["site"].tensor
    kept.resize_(1 << 16)
    kept.resize_(4)  # back to the shape of the key, in a new storage
    kept.fill_(1.0)
    assert not last.dense_differs("site", torch.ones(4), 16)


def test_a_record_compared_on_the_device_forgets_the_host_s_last_one() -> None:
    last = LastRecords()
    assert last.dense_differs("site", torch.ones(4), 16)
    assert last.differs("site", None)
    assert last.dense_differs("site", torch.ones(4), 16)  # nothing to compare it with


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
    env = {**os.environ, "CC": str(tmp_path / "no-cc"), "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_A_COMPILER],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(maxsplit=1) == ["ctypes", "[1, 3, 5]\n"]
    assert not list(tmp_path.rglob("*.so"))
