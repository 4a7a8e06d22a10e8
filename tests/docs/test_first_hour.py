"""Snags of a newcomer's first hour: advice that is right, extras named, help that reads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer, Trace


def _python(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_pre_save_callback_without_iteration_is_told_to_add_it() -> None:
    def halve(name: str, value: Any) -> Any:
        return value / 2

    with pytest.raises(TypeError) as error:
        ModelTracer(nn.Linear(2, 2), ["forward"], pre_save_callbacks=[halve])
    message = str(error.value)
    assert "pre_save_callbacks[0]" in message and "halve" in message
    assert "def cb(name, value, iteration)" in message
    assert "post_gather_callbacks" not in message


def test_a_gather_callback_among_the_pre_save_ones_is_still_sent_to_post_gather() -> None:
    def count(name: str, trace: Trace) -> None:
        pass

    with pytest.raises(TypeError, match=r"it takes \(name, trace\): pass it in post_gather"):
        ModelTracer(nn.Linear(2, 2), ["forward"], pre_save_callbacks=[count])


def test_to_frame_without_pandas_names_the_extra(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("forward.x", Trace([torch.ones(2)], [1], [0], [0]))
    result = _python(
        f"""
        import sys
        sys.modules["pandas"] = None  # as if it were not installed
        import vartrace
        with vartrace.open({str(path)!r}) as run:
            try:
                run.to_frame()
            except ImportError as error:
                print(type(error).__name__, error)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "needs pandas: pip install 'torch-vartrace[pandas]'" in result.stdout


def test_ls_lists_a_blosc_file_without_hdf5plugin(tmp_path: Path) -> None:
    pytest.importorskip("hdf5plugin", reason="writing a Blosc file needs hdf5plugin")
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, compression="blosc", metadata=False) as saver:
        # 32 KiB records fill their chunks: they are compressed
        records = [torch.ones(64, 128), torch.zeros(64, 128)]
        saver("layer.forward", Trace(records, [1, 2], [0, 0], [0, 1]))
    script = f"""
        import sys
        sys.modules["hdf5plugin"] = None  # as if it were not installed
        from vartrace.cli import main
        raise SystemExit(main([{{command!r}}, {str(path)!r}, *{{rest!r}}]))
        """
    listed = _python(script.format(command="ls", rest=[]))
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("layer.forward"))
    assert row.split()[1:5] == ["2", "(64,", "128)", "float32"]
    shown = _python(script.format(command="show", rest=["layer.forward", "-i", "1"]))
    assert shown.returncode == 2
    assert "blosc" in shown.stderr and "torch-vartrace[compress]" in shown.stderr


def test_plot_help_shows_both_forms_in_its_usage() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "vartrace", "plot", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    usage = result.stdout.split("\n\n", 1)[0].splitlines()
    assert usage == [
        "usage: vartrace plot RUN SITE... [--stat STAT] -o OUTPUT [--title T] [--ylabel Y] "
        "[--logy] [--allow-pickle]",
        "       vartrace plot A B -o OUTPUT [--atol ATOL] [--rtol RTOL] [--allow-pickle]",
    ]


def test_the_typed_example_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(Path(vartrace.__file__).parents[1] / "examples" / "typed_usage.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "records gathered: 0.forward=12, 2.forward.input=12" in result.stdout
    assert "0.forward: 12 records, iterations 1-12, float16" in result.stdout


def _write(path: Path, sites: dict[str, tuple[int, ...]], steps: int, gather: int) -> int:
    """Write ``steps`` float32 records of each site in gathers of ``gather``; record bytes."""
    with H5PYSaverCallback(path, metadata=False) as saver:
        for start in range(1, steps + 1, gather):
            for name, shape in sites.items():
                trace = Trace()
                for step in range(start, min(start + gather, steps + 1)):
                    trace.append(torch.full(shape, float(step)), step, 0, step)
                saver(name, trace)
            saver.flush()
    return steps * sum(4 * int(torch.Size(shape).numel()) for shape in sites.values())


def test_a_short_run_of_tiny_records_takes_little_space(tmp_path: Path) -> None:
    path = tmp_path / "tiny.h5"
    _write(path, {f"loss{i}": () for i in range(4)}, steps=9, gather=1)
    assert path.stat().st_size < 200 << 10  # 554 KiB when every tag chunk held 4096 rows
    with vartrace.open(path) as run:
        assert run["loss3"].iterations.tolist() == list(range(1, 10))


def test_chunks_follow_the_record_size_and_the_gather(tmp_path: Path) -> None:
    short = tmp_path / "short.h5"
    data = _write(short, {"tokens": (32, 8), "scores": (32, 4, 8, 8)}, steps=60, gather=25)
    assert short.stat().st_size < 1.25 * data  # 1.5x with 512 KiB chunks of small records
    long = tmp_path / "long.h5"
    _write(long, {"loss": ()}, steps=3000, gather=1000)
    with h5py.File(long, "r") as handle:
        site = handle["vars"]["loss"]
        assert site["tags"].chunks[0] >= 1000  # a chunk holds a whole gather's tags
        assert site["values"].chunks[0] >= 1000
    with vartrace.open(long) as run:
        assert run["loss"].get(2999) == 2999.0
