"""Shards of a real 2-rank gloo run: compared with the gathered file of the same run record
for record, tagged with a shared run id, and never merged with files of another run."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import vartrace
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import RunContext, Trace

PATHS = ["forward.step", "forward.x", "a.forward"]
WORLD = 2


class Net(nn.Module):
    """``step`` changes every ``every`` calls: ranks record it at different iterations."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.every = every
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        step = torch.full((2,), float(self.calls // self.every))
        return self.a(x).sum() + step.sum()


def _rank(rank: int, port: int, out: str) -> None:
    """One rank: the same training traced gathered, sharded, and sharded again (another run)."""
    import torch.distributed as dist

    from vartrace import ModelTracer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = Net(every=rank + 1)
    for gather, name in ((True, "gathered.h5"), (False, "shards.h5"), (False, "other.h5")):
        model.calls = 0
        saver = H5PYSaverCallback(Path(out) / name, metadata=False)
        with ModelTracer(
            model, PATHS, post_gather_callbacks=[saver], gathering_interval=2, gather=gather
        ):
            for i in range(6):
                model(torch.full((2, 3), float(10 * rank + i)))
        saver.close()
    # Rank 0 hosts the group's store, where each shard reads its run's id; the sharded runs
    # have no collective, so a rank that lags (a loaded machine) would find it gone.
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def run_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gloo")
    mp.start_processes(_rank, args=(_free_port(), str(out)), nprocs=WORLD, start_method="spawn")
    return out


def _compare(a: str, b: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vartrace", "compare", a, b],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_gathered_and_shards_of_one_run_compare_equal_every_way(run_files: Path) -> None:
    with vartrace.open(run_files / "shards.rank*.h5") as run:
        ranks = run["forward.step"].ranks.tolist()
        assert ranks.count(0) == 6 and ranks.count(1) == 4  # the pairing bug needs this
    pairs = [
        ("gathered.h5", "shards.rank*.h5"),
        ("shards.rank*.h5", "gathered.h5"),
        ("shards.rank*.h5", "shards.rank*.h5"),
        ("gathered.h5", "gathered.h5"),
    ]
    for a, b in pairs:
        report = vartrace.compare(run_files / a, run_files / b)
        assert report.ok and report.first_divergence is None, (a, b, str(report))
        assert sum(site.records for site in report.sites) == 3 * 6 * 2 - 2, (a, b)
        done = _compare(a, b, run_files)
        assert done.returncode == 0, (a, b, done.stdout, done.stderr)


@pytest.mark.slow
def test_shards_carry_a_shared_run_id_and_other_runs_are_refused(
    run_files: Path, tmp_path: Path
) -> None:
    ids = {}
    for name in ("shards", "other"):
        for rank in range(WORLD):
            with h5py.File(run_files / f"{name}.rank{rank}.h5", "r") as handle:
                assert handle.attrs["shard"].tolist() == [rank, WORLD]
                ids[name, rank] = handle.attrs["run_id"]
    assert ids["shards", 0] == ids["shards", 1] and ids["shards", 0]
    assert ids["other", 0] == ids["other", 1] != ids["shards", 0]
    mixed = [run_files / "shards.rank0.h5", run_files / "other.rank1.h5"]
    with pytest.raises(ValueError, match="are shards of different runs"):
        vartrace.open(mixed)
    for name in ("shards.rank0.h5", "other.rank1.h5"):
        shutil.copy(run_files / name, tmp_path / name.replace("other", "shards"))
    done = subprocess.run(
        [sys.executable, "-m", "vartrace", "ls", "shards.rank*.h5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "shards of different runs" in done.stderr, done
    with pytest.raises(ValueError, match="holds a run of its own"):
        vartrace.open([run_files / "gathered.h5", run_files / "shards.rank1.h5"])


def _single_run(path: Path, value: float) -> None:
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("w", Trace([torch.tensor(value)], [1], [0], [0]))


def test_a_glob_over_separate_runs_is_refused_not_merged(tmp_path: Path) -> None:
    _single_run(tmp_path / "run_a.h5", 1.0)
    _single_run(tmp_path / "run_b.h5", 2.0)
    with pytest.raises(ValueError, match=r"run_a\.h5 holds a run of its own"):
        vartrace.open(tmp_path / "run_*.h5")
    for stem in ("first", "second"):  # shards written without a process group: no run id
        saver = H5PYSaverCallback(tmp_path / f"{stem}.h5", metadata=False)
        saver.on_start(RunContext(rank=0 if stem == "first" else 1, world_size=2, sharded=True))
        saver("w", Trace([torch.tensor(0.0)], [1], [0], [0]))
        saver.close()
    with pytest.raises(ValueError, match="are shards of different runs"):
        vartrace.open([tmp_path / "first.rank0.h5", tmp_path / "second.rank1.h5"])


def test_a_missing_rank_is_reported(tmp_path: Path) -> None:
    for rank in (0, 2):
        saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
        saver.on_start(RunContext(rank=rank, world_size=3, sharded=True))
        saver("w", Trace([torch.tensor(float(rank))], [1], [rank], [0]))
        saver.close()
    with pytest.warns(RuntimeWarning, match=r"rank\(s\) 1 of a 3-rank run are missing"):
        run = vartrace.open(tmp_path / "run.rank*.h5")
    with run:
        assert run.missing_ranks == [1]
        assert run["w"].ranks.tolist() == [0, 2]
    done = subprocess.run(
        [sys.executable, "-m", "vartrace", "ls", "run.rank*.h5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0
    assert done.stderr.strip().splitlines() == [
        "vartrace: the shards of rank(s) 1 of a 3-rank run are missing: reading the other 2"
    ]


def _lagging_rank(rank: int, port: int, out: str) -> None:
    """Rank 1 starts its shard once rank 0 destroyed the group (and with it the store)."""
    import warnings

    import torch.distributed as dist

    from vartrace import ModelTracer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    if rank == 0:
        dist.destroy_process_group()
        (Path(out) / "destroyed").touch()
        return
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + 300
    while not (Path(out) / "destroyed").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    with contextlib.suppress(RuntimeError):  # until rank 0's store stops answering
        while time.monotonic() < deadline:
            store.set("ping", "")
            time.sleep(0.01)
    saver = H5PYSaverCallback(Path(out) / "late.h5", metadata=False)
    model = Net(every=1)
    with warnings.catch_warnings(record=True) as noted:
        warnings.simplefilter("always")
        with ModelTracer(model, PATHS, post_gather_callbacks=[saver], gather=False):
            model(torch.ones(2, 3))
        saver.close()
    (Path(out) / "warnings.txt").write_text("\n".join(str(w.message) for w in noted))


@pytest.mark.slow
def test_a_shard_written_after_the_store_went_is_said_to_lack_its_run_id(tmp_path: Path) -> None:
    mp.start_processes(
        _lagging_rank, args=(_free_port(), str(tmp_path)), nprocs=WORLD, start_method="spawn"
    )
    with h5py.File(tmp_path / "late.rank1.h5", "r") as handle:
        assert handle.attrs["run_id"] == ""
    noted = (tmp_path / "warnings.txt").read_text()
    assert "late.rank1.h5 is written without its run's id" in noted, noted
    assert "dist.barrier() before destroy_process_group()" in noted, noted
