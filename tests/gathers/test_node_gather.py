"""`ModelTracer(gather="node")`: one shard per node, gathered within each node.

The slow tests start two real ``torchrun --nnodes 2 --nproc-per-node 2`` runs of
``tests/_node_worker.py`` on this machine (two agents a run, ``--node-rank 0`` and
``1``, gloo, each node writing into a directory of its own): one with
``gather="node"``, one with ``gather=True``.  The workers count every point-to-point
message they send or receive.  The fast tests check the options and the node
numbering without a process group.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import vartrace
from vartrace.distributed.nodes import nodes_of
from vartrace.trace import RunContext, Trace

_HERE = Path(__file__).resolve().parents[1]
_WORKER = _HERE / "_node_worker.py"
DEADLINE_S = 120.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_run(gather: str, dirs: list[Path]) -> list[subprocess.Popen[str]]:
    """Start one torchrun agent per node (directory) for a run of the worker."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_HERE.parent), *sys.path])}
    env["OMP_NUM_THREADS"] = "1"
    agents = []
    for node, out in enumerate(dirs):
        out.mkdir()
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=2",
            f"--node-rank={node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(_WORKER),
            str(out),
            gather,
        ]
        agents.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return agents


def _finish(agents: list[subprocess.Popen[str]]) -> None:
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=DEADLINE_S)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
    codes = [agent.returncode for agent in agents]
    assert codes == [0, 0], f"torchrun exit codes {codes}:\n" + "\n".join(
        output[-3000:] for output in outputs
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """A `gather="node"` run and a `gather=True` run of the same script, each over two
    node-local directories; both started at once."""
    root = tmp_path_factory.mktemp("nodes")
    dirs = {gather: [root / f"{gather}{node}" for node in range(2)] for gather in ("node", "true")}
    started = [_start_run(gather, paths) for gather, paths in dirs.items()]
    for agents in started:
        _finish(agents)
    return dirs


def _counts(dirs: list[Path]) -> dict[int, dict[str, Any]]:
    reports = [json.loads(p.read_text()) for out in dirs for p in sorted(out.glob("rank*.json"))]
    return {report["rank"]: report for report in reports}


@pytest.mark.slow
def test_each_node_writes_one_shard_and_nothing_is_sent_to_another_node(
    runs: dict[str, list[Path]],
) -> None:
    node_dirs = runs["node"]
    assert [sorted(p.name for p in out.glob("*.h5")) for out in node_dirs] == [
        ["run.node0.h5"],
        ["run.node1.h5"],
    ]
    for node, out in enumerate(node_dirs):
        with h5py.File(out / f"run.node{node}.h5", "r") as handle:
            assert list(handle.attrs["shard"]) == [node, 2]
            assert list(handle.attrs["node_ranks"]) == [2 * node, 2 * node + 1]
            assert handle.attrs["world_size"] == 4
        with pytest.warns(RuntimeWarning, match="missing"):  # the other node's shard
            shard = vartrace.open(out / f"run.node{node}.h5")
        with shard:  # its own ranks' records
            other = 1 - node
            assert shard.missing_ranks == [2 * other, 2 * other + 1]  # global ranks
            ranks = {int(r) for name in shard.names for r in shard[name].ranks}
            assert ranks == {2 * node, 2 * node + 1}
    counts = _counts(node_dirs)
    assert sorted(counts) == [0, 1, 2, 3]
    for rank, report in counts.items():
        peers = {message["peer"] for message in report["messages"]}
        assert peers <= set(report["node_ranks"]) - {rank}, (rank, report["messages"])
        sent = [m for m in report["messages"] if m["kind"] == "send"]
        received = [m for m in report["messages"] if m["kind"] == "recv"]
        if report["local_rank"] == 0:  # the node's first rank receives, sends nothing
            assert received and not sent, report["messages"]
        else:  # records, and the large ones as messages of their own (300 KiB)
            assert {m["peer"] for m in sent} == {report["node_ranks"][0]}
            assert max(m["bytes"] for m in sent) >= 300 * 256 * 4
    gathered = _counts(runs["true"])  # the gathered run does send across nodes
    assert {m["peer"] for m in gathered[2]["messages"] if m["kind"] == "send"} == {0}


@pytest.mark.slow
def test_the_node_shards_read_together_equal_the_run_gathered_to_rank_0(
    runs: dict[str, list[Path]],
) -> None:
    shards = [out / f"run.node{node}.h5" for node, out in enumerate(runs["node"])]
    with vartrace.open(shards) as nodes, vartrace.open(runs["true"][0] / "run.h5") as whole:
        assert nodes.missing_ranks == [] and sorted(nodes.names) == sorted(whole.names)
        assert set(whole.names) == {"forward.x", "forward.h", "forward.wide", "layer.forward"}
        for name in whole.names:
            mine, theirs = nodes[name], whole[name]
            # Across shards, records are in (iteration, rank, order) order, as the shards
            # of gather=False; the gathered file holds the same records, gather by gather.
            key = np.lexsort((theirs.order, theirs.ranks, theirs.iterations))
            for field in ("iterations", "ranks", "order"):
                assert np.array_equal(getattr(mine, field), getattr(theirs, field)[key]), name
            assert len(mine.iterations) == len(theirs.iterations) > 0
            for index, other in enumerate(key.tolist()):
                got, want = _value(mine, index), _value(theirs, other)
                assert got.dtype == want.dtype and got.shape == want.shape, (name, index)
                assert got.tobytes() == want.tobytes(), (name, index)
            assert set(mine.ranks.tolist()) == {0, 1, 2, 3}


def _value(site: Any, index: int) -> np.ndarray:
    """Record `index` of `site` in its exact shape."""
    return np.asarray(site.values[index])[tuple(slice(0, n) for n in site.shapes[index])]


def test_an_unknown_gather_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"gather must be True or False, not 'nodes'.*'node'"):
        vartrace.ModelTracer(nn.Linear(2, 2), ["forward"], gather="nodes")  # type: ignore[arg-type]


def test_gather_node_in_one_process_writes_the_file_gather_true_writes(tmp_path: Path) -> None:
    saver = vartrace.H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
    model = nn.Linear(2, 2)
    with vartrace.ModelTracer(model, ["forward"], post_gather_callbacks=[saver], gather="node"):
        model(torch.ones(1, 2))
    saver.close()
    assert [p.name for p in tmp_path.iterdir()] == ["run.h5"]
    with vartrace.open(tmp_path / "run.h5") as run:
        assert run["forward"].ranks.tolist() == [0]


def test_nodes_are_numbered_by_the_launchers_node_rank_else_by_host() -> None:
    assert nodes_of([(1, "a"), (0, "a"), (1, "a"), (0, "a")]) == [[1, 3], [0, 2]]
    assert nodes_of([(None, "b"), (None, "a"), (None, "b"), (None, "c")]) == [[0, 2], [1], [3]]
    assert nodes_of([(0, "a"), (None, "a"), (None, "b")]) == [[0, 1], [2]]  # not all launched


@pytest.mark.parametrize("manifests", [True, False])
def test_a_missing_node_shard_is_reported_by_the_global_ranks_it_held(
    tmp_path: Path, manifests: bool
) -> None:
    """Three nodes of two ranks, written by the saver as the node's first rank writes them;
    the shard of node 1 (ranks 2 and 3) is left out, read through the manifests or not."""
    for node in range(3):
        ranks = (2 * node, 2 * node + 1)
        saver = vartrace.H5PYSaverCallback(tmp_path / f"node{node}" / "run.h5", metadata=False)
        (tmp_path / f"node{node}").mkdir()
        context = RunContext(
            rank=ranks[0], world_size=6, sharded=True, node=node, nodes=3, node_ranks=ranks
        )
        saver.on_start(context)
        for rank in ranks:
            saver("forward", Trace([torch.full((2,), float(rank))], [1], [rank], [0]))
        saver.close()
    if not manifests:
        for manifest in tmp_path.glob("node*/*.manifest.json"):
            manifest.unlink()
    with pytest.warns(RuntimeWarning, match=r"node\(s\) 1 of a 3-node run .* rank\(s\) 2, 3 of"):
        run = vartrace.open([tmp_path / "node0", tmp_path / "node2"])
    with run:
        assert run.missing_ranks == [2, 3]
        assert sorted(run["forward"].ranks.tolist()) == [0, 1, 4, 5]
        assert [m is not None for m in run.manifests] == [manifests, manifests]
    with vartrace.open([tmp_path / f"node{node}" for node in range(3)]) as whole:
        assert whole.missing_ranks == []
