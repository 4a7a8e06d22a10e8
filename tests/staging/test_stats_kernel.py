"""The fused statistics summary (``torch.ops.vartrace.summary``): ops, temporaries, numerics.

One op per record on the capturing thread, no float64 copy of the record, and the same
numbers as the float64 reference of ``tests/tracing/test_stats.py`` from each implementation:
the compiled CPU kernel (``summary.c``) and the numpy one it falls back to (with blocks small
enough that every merge runs), the op on the CPU and on the stand-in device, the eager
fallback, and the CUDA kernels written in Triton, run by Triton's interpreter on CPU tensors
where ``triton`` is installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tracemalloc
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import vartrace
import vartrace.statistics.kernels as kernels
from tests import simgpu
from tests._env import run_without_a_compiler
from tests.tracing.test_stats import SPECIAL, assert_matches, reference, tensors
from vartrace.statistics import compiled
from vartrace.statistics.named import SUMMARY_FIELDS
from vartrace.statistics.records import Statistics

SUMMARY = vartrace.stats()


class Dispatched(TorchDispatchMode):
    """The aten (and custom) ops dispatched on this thread, and the bytes they return."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes += t.numel() * t.element_size()
        return out


def as_statistics(row: torch.Tensor) -> Statistics:
    """A summary row (11 float64, any device) as the record ``vartrace.stats()`` makes."""
    host = simgpu.peek(row) if isinstance(row, simgpu.SimTensor) else row.cpu()
    record = SUMMARY._template.copy()
    record[1:] = host.numpy()
    return Statistics.of(record)


def expected(tensor: torch.Tensor) -> dict[str, Any]:
    want = reference(tensor.to(torch.float64).numpy())
    return {name: want[name] for name in SUMMARY_FIELDS}


def activations(dtype: torch.dtype, size: int = 300_001) -> torch.Tensor:
    """Large records: a big mean with a tiny spread (naive one-pass formulas lose digits
    there), with NaN, both infinities and zeros spread over several blocks."""
    generator = torch.Generator().manual_seed(0)
    x = 1e4 + 1e-3 * torch.randn(size, dtype=torch.float64, generator=generator)
    if dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        x = torch.randn(size, dtype=torch.float64, generator=generator)
    x[[7, size // 4, size // 2]] = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype)
    x[size * 2 // 3 :][:10] = 0.0
    return x.to(dtype)


# -- ops and temporaries on the capturing thread ----------------------------------------------


def test_a_record_is_one_op_on_the_stand_in_device_and_no_kernel_on_the_cpu() -> None:
    """On a device the op, header written too; on the CPU its kernel called directly: views
    of the tensor for numpy (``detach``, ``lift_fresh``), no aten kernel touching data."""
    simgpu.LOG.clear()  # (the log is the process's: earlier tests' syncs are theirs)
    for value in (simgpu.to_device(torch.randn(64, 33)), torch.randn(64, 33)):
        SUMMARY("site", value, 1)  # the op registered, constants on the device
        with Dispatched() as seen:
            record = SUMMARY("site", value, 1)
        if value.is_cpu:  # views (their bytes are the tensor's, not new memory)
            assert set(seen.ops) <= {"aten.detach.default", "aten.lift_fresh.default"}, seen.ops
            assert len(seen.ops) <= 8
        else:
            assert seen.ops == ["vartrace.summary.default"], seen.ops
            assert seen.bytes <= 1024  # the record: 96 bytes
        assert record.device == value.device and record.nbytes == 96
    assert simgpu.LOG.syncs() == []


def test_a_record_allocates_one_float64_block_at_most_on_the_cpu() -> None:
    """No float64 copy of the record (today's numpy path made one: 32 MiB here): the
    kernel's temporaries are one block's buffers (float64, bool, bfloat16 widened, numpy's
    casting buffer: under 16 bytes a value, `BLOCK` values at most), 2 MiB at most."""
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        peak = _peak_of_summary(torch.randn(4 << 20).to(dtype))
        assert peak <= kernels.BLOCK * 16, (dtype, peak)


def _peak_of_summary(x: torch.Tensor) -> int:
    """The peak of memory Python's allocators traced while `x` was reduced, the second
    time (the first registers the op and makes float8's table of 256 values)."""
    SUMMARY("site", x, 1)
    tracemalloc.start()
    try:
        SUMMARY("site", x, 1)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_op_is_traceable_and_checked_by_opcheck() -> None:
    op = kernels.summary_op()
    assert op is torch.ops.vartrace.summary.default
    for x in (torch.randn(5, 7), torch.randn(3).bfloat16(), torch.arange(6).reshape(2, 3)):
        torch.library.opcheck(op, (x,))  # compares with assert_close: rows without NaN
    with torch._subclasses.FakeTensorMode() as mode:
        fake = op(mode.from_tensor(torch.empty(0, 4)))
    assert fake.shape == (11,) and fake.dtype == torch.float64


def test_a_record_of_a_tensor_that_requires_grad_has_no_graph() -> None:
    x = torch.randn(8, requires_grad=True) * 2
    record = SUMMARY("site", x, 1)
    assert not record.requires_grad and record.grad_fn is None


# -- numerics: every implementation against the float64 reference ----------------------------

EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


@EXAMPLES
@given(tensors(), st.sampled_from([1, 3, 8, 1 << 16]))
def test_the_numpy_kernel_equals_the_reference_with_any_block(
    tensor: torch.Tensor, block: int
) -> None:
    """Small blocks: the Chan merge of several blocks and all-NaN blocks are exercised."""
    previous, kernels.BLOCK = kernels.BLOCK, block
    try:
        with _numpy_kernel():
            row = kernels.summary(tensor)
    finally:
        kernels.BLOCK = previous
    assert row.dtype == torch.float64 and row.shape == (11,)
    assert_matches(as_statistics(row), expected(tensor))


@contextlib.contextmanager
def _numpy_kernel() -> Iterator[None]:
    """The CPU op computes with the numpy kernel for a while, as where no compiler is."""
    saved, compiled._kernel = compiled._kernel, False
    try:
        yield
    finally:
        compiled._kernel = saved


needs_compiled = pytest.mark.skipif(
    not compiled.available(), reason="no C compiler or Python.h here: numpy computes statistics"
)


@st.composite
def long_tensors(draw: st.DrawFn) -> torch.Tensor:
    """Up to 3,000 values (several chunks of the vector loops, a tail), a spread that cancels
    or not, a few specials anywhere (past the first chunk too), in the compiled kinds."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64]))
    size = draw(st.integers(0, 3000).filter(lambda n: n != 1))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    offset, scale = draw(st.sampled_from([(0.0, 1.0), (1e4, 1e-3), (1.0, 1e-8), (-3.0, 1e3)]))
    x = offset + scale * torch.randn(size, dtype=torch.float64, generator=generator)
    if size:
        for at, special in draw(st.lists(st.tuples(st.integers(0, size - 1), SPECIAL), max_size=4)):
            x[at] = special
    if not dtype.is_floating_point:
        return x.nan_to_num(0.0, 0.0, 0.0).round().to(dtype)
    return x.to(dtype)


@needs_compiled
@EXAMPLES
@given(long_tensors() | tensors(), st.sampled_from([1, 3, 8, 1000, 1 << 17]))
def test_the_compiled_kernel_equals_the_reference_with_any_block(
    tensor: torch.Tensor, block: int
) -> None:
    """The vector loops (8 values an instruction), their plain sums given up for masked
    ones at a NaN or an infinity, the centred pass where plain sums cancel, the tail
    in plain C and the merge of blocks: the same fields as the reference, every dtype
    (those the kernel does not read fall back to numpy)."""
    previous, kernels.BLOCK = kernels.BLOCK, block
    try:
        row = kernels.summary(tensor)
    finally:
        kernels.BLOCK = previous
    assert row.dtype == torch.float64 and row.shape == (11,)
    assert_matches(as_statistics(row), expected(tensor))


FALLBACK = """
import warnings

import torch

warnings.simplefilter("error")
import vartrace
from vartrace.statistics import compiled

record = vartrace.stats()("site", torch.arange(10.0), 1)
print(compiled.available(), record[3].item())
"""


def test_without_a_compiler_statistics_come_from_the_numpy_kernel(tmp_path: Path) -> None:
    """`$CC` names no compiler: the same record, from numpy, without a warning."""
    output = run_without_a_compiler(FALLBACK, tmp_path)
    assert output.split() == ["False", str(np.std(np.arange(10.0)))]


@needs_compiled
def test_the_compiled_kernel_is_built_once_and_loaded_from_the_cache(tmp_path: Path) -> None:
    """The first process builds the module into `$XDG_CACHE_HOME/vartrace`, the next loads
    that file as it is."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    built = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["True", str(np.std(np.arange(10.0)))]
        built.append([(path.name, path.stat().st_mtime_ns) for path in tmp_path.rglob("*.so")])
    assert len(built[0]) == 1 and built[0] == built[1]


@EXAMPLES
@given(tensors())
def test_the_eager_fallback_equals_the_reference(tensor: torch.Tensor) -> None:
    assert_matches(as_statistics(kernels.eager_summary(tensor)), expected(tensor))


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn],
)
def test_large_records_on_the_cpu_and_the_stand_in_device(dtype: torch.dtype) -> None:
    x = activations(dtype)
    want = expected(x)
    assert_matches(as_statistics(kernels.summary(x)), want)
    transposed = x[:300_000].reshape(500, 600).T  # dense in another order: read as it is
    assert_matches(as_statistics(kernels.summary(transposed)), expected(transposed))
    assert_matches(Statistics.of(simgpu.peek(SUMMARY("site", simgpu.to_device(x), 1))), want)


def test_complex_values_are_reduced_by_magnitude() -> None:
    z = torch.tensor([3 + 4j, -1j, complex(math.nan, 0), 0j])
    want = expected(z.abs())
    assert_matches(as_statistics(kernels.summary(z)), want)
    assert_matches(as_statistics(kernels.summary(z.conj())), want)
    assert_matches(Statistics.of(SUMMARY("site", z.numpy(), 1)), want)


@pytest.mark.parametrize("size", [40, 5000, 300_001])  # numpy's BLAS, torch's, several blocks
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_plain_sums_give_way_to_centred_ones_where_they_would_cancel(
    size: int, dtype: torch.dtype
) -> None:
    """A block's variance comes from its plain sums while mean**2 <= 15x the variance, from
    its centred values past that: either side of the bound, and far past it, the fields
    equal the float64 reference."""
    generator = torch.Generator().manual_seed(size)
    noise = torch.randn(size, dtype=torch.float64, generator=generator)
    noise = (noise - noise.mean()) / noise.std(correction=0)  # mean 0, variance 1 exactly-ish
    for ratio in (0.25, 14.0, 15.0, 16.0, 1e3, 1e12):
        x = (math.sqrt(ratio) + noise).to(dtype)
        assert_matches(as_statistics(kernels.summary(x)), expected(x))


def test_float64_values_are_reduced_where_they_lie() -> None:
    """No float64 copy of float64 values, not even a block's: their sums are read in place
    (a bool block compares them with zero)."""
    peak = _peak_of_summary(torch.randn(4 << 20, dtype=torch.float64))
    assert peak <= kernels.BLOCK * 2, peak


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size", [100, 5000, 20_000])  # sorted copy, numpy's BLAS, torch's
def test_non_finite_values_are_counted_and_left_where_they_lie(
    size: int, dtype: torch.dtype, sign: float
) -> None:
    """Masked attention scores (-inf above the diagonal) and the like: the infinities and
    NaN counted from the block's sum (a single infinity) or by comparison (NaN), the
    finite values' extremes kept when all have one sign (no stand-in zero among them),
    and the record's own values left unchanged."""
    generator = torch.Generator().manual_seed(size)
    finite = sign * (1.0 + torch.rand(size, dtype=torch.float64, generator=generator))
    for special in ([-math.inf], [math.inf], [math.nan], [math.nan, math.inf, -math.inf]):
        x = finite.clone().to(dtype)
        x[1::3] = torch.tensor(special, dtype=dtype).repeat(size)[: len(x[1::3])]
        before = x.clone()
        assert_matches(as_statistics(kernels.summary(x)), expected(x))
        assert torch.equal(x.nan_to_num(), before.nan_to_num()), special


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32])
def test_read_only_arrays_are_reduced_without_a_warning(dtype: type) -> None:
    """torch reads only arrays it may write (and warns of the others): numpy reduces these."""
    values = (np.arange(100_000) % 7 - 3).astype(dtype)
    values.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        row = kernels.summarize_values(values)
    assert_matches(as_statistics(torch.from_numpy(row)), expected(torch.from_numpy(values.copy())))


# -- the CUDA kernels, in Triton's interpreter on CPU tensors ---------------------------------


@contextlib.contextmanager
def _interpreting() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` for a while: Triton reads it when it decorates and runs."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _interpreted_triton() -> types.ModuleType | None:
    """A fresh copy of ``vartrace.statistics.triton_kernel`` whose kernels Triton interprets."""
    if importlib.util.find_spec("triton") is None:
        return None
    spec = importlib.util.find_spec("vartrace.statistics.triton_kernel")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with _interpreting():
        spec.loader.exec_module(module)
    return module


# Triton decides at decoration whether a function is interpreted, its standard library's
# included (decorated when triton is first imported): its interpreter works only in a process
# started with TRITON_INTERPRET=1.  The kernels' tests run in such a process of their own
# (test_the_triton_kernels_run_in_the_interpreter), where they run here for real.
HAS_TRITON = importlib.util.find_spec("triton") is not None
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TRITON = _interpreted_triton() if IN_INTERPRETER else None
needs_triton = pytest.mark.skipif(
    TRITON is None,
    reason="runs in a process started with TRITON_INTERPRET=1, by "
    "test_the_triton_kernels_run_in_the_interpreter"
    if HAS_TRITON
    else "triton is not installed",
)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(IN_INTERPRETER, reason="this is the process it starts")
def test_the_triton_kernels_run_in_the_interpreter() -> None:
    tests = "triton_kernels_equal_the_reference or triton_kernels_on_large_records"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", tests],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "4 passed" in result.stdout, result.stdout[-2000:]


def triton_summary(tensor: torch.Tensor, block: int, spans: int, tile: int) -> torch.Tensor:
    """The CUDA implementation's two launches, interpreted, with the given tile sizes."""
    assert TRITON is not None
    saved = TRITON._BLOCK, TRITON._SPANS, TRITON._TILE
    TRITON._BLOCK, TRITON._SPANS, TRITON._TILE = block, spans, tile
    try:
        with _interpreting(), np.errstate(all="ignore"):  # 0 / 0: the NaN mean of no values
            return TRITON.summary(tensor)
    finally:
        TRITON._BLOCK, TRITON._SPANS, TRITON._TILE = saved


def _loaded_by_triton(tensor: torch.Tensor) -> bool:
    assert TRITON is not None
    return tensor.dtype in TRITON.DTYPES or tensor.element_size() == 1


@needs_triton
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(tensors(), st.sampled_from([(8, 2, 2), (16, 1024, 1024), (1024, 1024, 1024)]))
def test_the_triton_kernels_equal_the_reference(
    tensor: torch.Tensor, sizes: tuple[int, int, int]
) -> None:
    """Tiles of 8 values, two spans, partials merged two at a time: every merge runs."""
    assert _loaded_by_triton(tensor)
    row = triton_summary(tensor, *sizes)
    assert row.dtype == torch.float64 and row.shape == (11,)
    assert_matches(as_statistics(row), expected(tensor))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_triton_kernels_on_large_records(dtype: torch.dtype) -> None:
    x = activations(dtype, size=100_003)
    assert_matches(as_statistics(triton_summary(x, 1024, 16, 4)), expected(x))


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vartrace.statistics import triton_kernel as _triton

target, options = GPUTarget("cuda", 90, 32), {"enable_fp_fusion": False}
pointers = {"table_ptr": "*fp64", "part_ptr": "*fp64", "size": "i64", "tiles": "i32"}
constants = {"BLOCK": "constexpr", "DECODE": "constexpr"}
for dtype in ["fp32", "bf16", "fp16", "fp64", "i64", "i8", "u8", "i1", "u8 decoded"]:
    signature = {"x_ptr": "*" + dtype.split()[0], **pointers, **constants}
    given = {"BLOCK": 1024, "DECODE": dtype.endswith("decoded")}
    kernel = triton.compile(ASTSource(_triton._partials, signature, given), target, options)
    assert "ld.global" in kernel.asm["ptx"], dtype
signature = {"part_ptr": "*fp64", "out_ptr": "*fp64", "spans": "i32", "size": "i64"}
signature["header"] = "fp64"
source = ASTSource(
    _triton._finish,
    {**signature, "TILE": "constexpr", "FIRST": "constexpr"},
    {"TILE": 1024, "FIRST": 1},
)
assert "st.global" in triton.compile(source, target, options).asm["ptx"]
print("compiled")
"""


@needs_triton
@pytest.mark.slow
def test_the_triton_kernels_compile_for_an_h100_without_one() -> None:
    """The compiled path (types, constants, specialisation) down to PTX for sm_90, for
    every dtype the kernels load, in a process of its own (the interpreter patches
    ``triton.language`` in this one): the interpreter does not check those."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "compiled", done.stderr[-3000:]


GLOBALS = """
from vartrace.statistics import triton_kernel as _triton

for kernel in (_triton._partials, _triton._finish):
    kernel.cache_key  # finds the globals the kernel reads, as its first launch does
    for (name, _), (value, space) in kernel.used_global_vals.items():
        assert not space.get(name) != value, (kernel.fn.__name__, name, value)
print("unchanged")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_triton_kernels_read_only_globals_that_equal_themselves() -> None:
    """Every launch on a GPU checks that the globals a kernel read at its compile are
    still equal (``!=``): a NaN constant fails that check, and did, on an H200, at the
    first statistics record.  The interpreter does not check; this runs the same
    comparison, in a process without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", GLOBALS], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "unchanged", done.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(IN_INTERPRETER, reason="the interpreter runs the kernels on the CPU")
def test_kernels_that_cannot_launch_give_way_to_eager_ops_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Triton that fails at a launch (here: a CPU tensor, no GPU driver to launch on)
    must not break the step it watches: the eager ops take over, saying so once."""
    monkeypatch.setattr(kernels, "_triton", None)  # imported afresh, as in a new process
    x, y = torch.randn(1000), torch.randn(10)
    with pytest.warns(RuntimeWarning, match="Triton's kernels failed") as caught:
        first = kernels._cuda_summary(x, 3.0)
        second = kernels._cuda_summary(y)
    assert len(caught) == 1
    assert kernels._triton is False
    assert first[0] == 3.0
    assert_matches(as_statistics(first[1:]), expected(x))
    assert_matches(as_statistics(second), expected(y))


def test_the_cuda_kernel_falls_back_to_eager_for_dtypes_triton_does_not_load() -> None:
    """uint32 (no Triton pointer type here) takes the eager formulation."""
    x = torch.tensor([1, 0, 7], dtype=torch.uint32)
    row: Callable[[torch.Tensor], torch.Tensor] = kernels._cuda_summary
    assert_matches(as_statistics(row(x)), expected(x))


@pytest.mark.slow
def test_the_benchmark_prints_op_counts_times_and_the_step_ratio() -> None:
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench_stats.py"
    argv = ["--sizes", "4096", "--rounds", "1", "--block", "1", "--budget", "0.05"]
    done = subprocess.run(
        [sys.executable, str(tool), *argv], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split()[1]: line for line in done.stdout.splitlines() if "4096" in line}
    assert set(rows) == {"float32", "bfloat16"}
    for row in rows.values():  # ops of eager (44 with torch 2.13), fused and clone
        eager, fused, clone = (int(cell.split()[0]) for cell in row.split("|")[1:4])
        assert eager > 30 and fused <= 8 and clone == 1, row  # fused: views for numpy
    assert "vartrace.stats()" in done.stdout and "1.000x" in done.stdout


_CALLGRIND = pytest.mark.skipif(
    not (shutil.which("valgrind") and shutil.which("callgrind_control")),
    reason="needs valgrind's callgrind",
)


@pytest.fixture(scope="module")
def instruction_ratios() -> dict[str, float]:
    """Statistics over clone in instructions under callgrind, by record size (the first
    cell of each row of ``bench_stats.py --instructions``, run once for the tests here)."""
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench_stats.py"
    done = subprocess.run(
        [sys.executable, str(tool), "--instructions", "--budget", "0.05"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    return {
        row[0]: float(next(cell for cell in row if cell.endswith("x"))[:-1])
        for row in rows
        if row and row[0][0].isdigit()
    }


@pytest.mark.slow
@_CALLGRIND
def test_statistics_of_a_large_float32_record_cost_under_twenty_clones_of_it(
    instruction_ratios: dict[str, float],
) -> None:
    """Counted by callgrind (the same every run): 1 MiB of float32 values, statistics
    against the clone that records them whole (33x before the BLAS sums, 14x since)."""
    ratio = instruction_ratios["262,144"]
    assert ratio < 20, ratio


@pytest.mark.slow
@_CALLGRIND
def test_statistics_of_a_tiny_record_cost_fewer_clones_than_before_the_sorted_copy(
    instruction_ratios: dict[str, float],
) -> None:
    """64 float32 values: the fixed cost of a record, from one sorted copy (10.1x the clone
    when it was reduced as a block of ~20 numpy and torch calls).  The clone's own cost
    moves with torch: 6.8x on Python 3.11 with torch 2.13, 8.4x on 3.12 with torch 2.15,
    so the bound leaves that room."""
    ratio = instruction_ratios["64"]
    assert ratio < 9.5, ratio


class _ShortOfMemory:
    """Stands for Triton's kernels on a device whose memory is full (no GPU here to fill)."""

    DTYPES = (torch.float32,)

    def __init__(self) -> None:
        self.calls = 0

    def summary(self, x: torch.Tensor, header: float | None = None) -> torch.Tensor:
        self.calls += 1
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")


def test_a_device_short_of_memory_takes_eager_ops_for_that_record_and_keeps_triton(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of memory is the device's state, not a broken Triton: no warning that Triton
    failed, and the next record tries the kernels again."""
    short = _ShortOfMemory()
    monkeypatch.setattr(kernels, "_triton", short)
    x = torch.randn(1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = kernels._cuda_summary(x)
        kernels._cuda_summary(x)
    assert kernels._triton is short and short.calls == 2
    assert_matches(as_statistics(first), expected(x))
