"""Tracing under parallelism beyond plain DDP, on real gloo process groups.

Tensor parallelism (`parallelize_module` on a `DeviceMesh`), process sub-groups
(`new_group`), pipeline schedules, `Join` with uneven inputs and FSDP2, each on 1 to 4
spawned ranks running a scenario of ``tests/_parallel_workers.py``, with the hard
deadline of ``test_distributed._launch``: a hang is a failure, never a stuck CI.  Values
are compared bit for bit with what the model's own hooks and tensors held on each rank;
what memory holds while gathers wait is counted with weak references to the records.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import vartrace
from tests.gathers.test_distributed import _assert_same_value, _run_ok
from vartrace.distributed.spill import Spill

workers = importlib.import_module("tests._parallel_workers")

pytestmark = pytest.mark.slow


def _same_bits(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert isinstance(got, torch.Tensor), f"{where}: {got!r}"
    assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got} != {want}"
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{where}: {got} != {want}"


def test_tensor_parallel_records_each_ranks_local_shard_bit_exact(tmp_path: Path) -> None:
    """A DTensor record once killed the process (its bytes read at address 0) or raised
    in the saver; now each rank records its local shard, with a warning naming the
    placement, and the step is the untraced one."""
    pytest.importorskip("torch.distributed.tensor.parallel")
    world = 2
    results = _run_ok("tests._parallel_workers:tensor_parallel", world, tmp_path)
    for staging in ("sync", "async"):
        with vartrace.open(tmp_path / f"tp-{staging}.h5") as run:
            for rank, found in enumerate(results):
                assert found[f"losses-{staging}"] == found["untraced"]
                truth = found[f"truth-{staging}"]
                for name in workers.TP_SITES:
                    site = run[name if "." in name else f"{name}.forward"]
                    for step, want in enumerate(truth[name], start=1):
                        where = f"{staging} {name} rank {rank} iteration {step}"
                        _same_bits(site.get(step, rank=rank), want, where)
            assert set(run["a.weight"].ranks.tolist()) == {0, 1}
            bindings = sorted(name for name in run.names if name.startswith("forward.w@every"))
            assert len(bindings) == 2, run.names
            for rank, found in enumerate(results):
                for step, weight in enumerate(found[f"truth-{staging}"]["a.weight"], start=1):
                    for site, want in zip(bindings, (weight * 2, weight * 2 + 1), strict=True):
                        _same_bits(run[site].get(step, rank=rank), want, f"{site} {rank}")
    warned = " ".join(results[0]["warnings-sync"])  # once a site in a process: the first run
    assert "a.weight is a DTensor of shape (8, 4) placed (Shard(dim=0))" in warned
    assert "b.weight is a DTensor of shape (4, 8) placed (Shard(dim=1))" in warned
    # b's output as its caller receives it: tensor parallelism's output hook all-reduced
    # the Partial(sum) DTensor into a plain tensor, so no placement to name
    assert "b.forward" not in warned
    assert "local shard, of shape (4, 4) here" in warned


def test_tensor_parallel_records_assemble_into_the_whole_tensors_bit_exact(
    tmp_path: Path,
) -> None:
    """A DTensor's records once kept only each rank's shard: no placement was stored, and
    a reader could not tell how the shards join.  Now the site keeps its placement (in
    the file and in memory) and `vartrace.assemble` gives, bit for bit, what
    `full_tensor()` gave in the worker: `Shard(0)`, `Shard(1)` (also a colwise layer's
    DTensor output) and `Replicate()` (a rowwise layer's bias and its gradient), and an
    `@every` series of DTensor bindings, in memory as in the file."""
    pytest.importorskip("torch.distributed.tensor.parallel")
    results = _run_ok("tests._parallel_workers:tensor_parallel_assembled", 2, tmp_path)
    found = results[0]
    for step in range(workers.STEPS):
        for name in workers.ASSEMBLED_SITES:
            want = found["truth-memory"][name][step]
            _same_bits(found["assembled"][name][step], want, f"memory {name} {step + 1}")
        weight = found["truth-memory"]["a.weight"][step]  # `w`'s last binding: weight * 2 + 1
        _same_bits(found["assembled"]["forward.w@every"][step], weight * 2 + 1, f"w {step}")
    placement = vartrace.Placement(("Shard(dim=0)",), (2,), (0, 1), (8, 4))
    assert found["placements"]["a.weight"] == placement
    for staging in ("sync", "async", "shards"):
        assert found[f"losses-{staging}"] == results[1][f"losses-{staging}"]
        files = "assembled-shards.rank*.h5" if staging == "shards" else f"assembled-{staging}.h5"
        with vartrace.open(tmp_path / files) as run:
            for name in workers.ASSEMBLED_SITES:
                site = run[name if "." in name else f"{name}.forward"]
                for step, want in enumerate(found[f"truth-{staging}"][name], start=1):
                    where = f"{staging} {name} iteration {step}"
                    _same_bits(vartrace.assemble(site, step), want, where)
                    if name == "a.weight":
                        got = vartrace.assemble(run["forward.w@every"], step)
                        _same_bits(got, want * 2 + 1, f"w {where}")
            assert run["a.weight"].placement == placement
            assert run["b.weight@grad"].placement.placements == ("Shard(dim=1)",)
            assert run["b.bias"].placement.placements == ("Replicate()",)
            assert run["a.forward"].placement.placements == ("Shard(dim=1)",)
            assert run["a.forward"].placement.shape == (2, 8)
    shown = subprocess.run(  # the command line names the placement and the way to join
        [sys.executable, "-m", "vartrace", "show", str(tmp_path / "assembled-sync.h5"), "a.weight"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "each rank's shard of Shard(dim=0) on a mesh (2,) of ranks 0, 1, shape (8, 4): "
        "vartrace.assemble(run['a.weight'], iteration) joins them"
    ) in shown, shown
    for rank in range(2):  # each rank's own file says how the shards join (docs/format.md)
        with h5py.File(tmp_path / f"assembled-shards.rank{rank}.h5", "r") as file:
            attrs = file["vars"]["a.weight"].attrs
            assert attrs["placements"] == "Shard(dim=0)"
            assert [attrs[k].tolist() for k in ("mesh_shape", "mesh_ranks", "global_shape")] == [
                [2],
                [0, 1],
                [8, 4],
            ]


def test_placements_of_a_two_dimensional_mesh_assemble_and_partial_sums_are_refused() -> None:
    """`Shard` on both dimensions of a 2 x 2 mesh (the same tensor dimension twice: the
    second mesh dimension shards the first one's pieces, as torch does), `Replicate`
    on one of them; a `Partial` sum, or a site that recorded no DTensor, is refused
    with a message saying why."""
    whole = torch.arange(64.0).reshape(8, 8)

    def pieces(first: int, second: int | None) -> dict[int, torch.Tensor]:
        """The local shard of each rank of the mesh [[3, 1], [0, 2]]."""
        grid = [[3, 1], [0, 2]]
        found = {}
        for i, j in [(0, 0), (0, 1), (1, 0), (1, 1)]:
            piece = whole.chunk(2, first)[i]
            found[grid[i][j]] = piece if second is None else piece.chunk(2, second)[j]
        return found

    for placements, first, second in [
        (("Shard(dim=0)", "Shard(dim=1)"), 0, 1),
        (("Shard(dim=0)", "Shard(dim=0)"), 0, 0),
        (("Shard(dim=-1)", "Replicate()"), -1, None),
    ]:
        placement = vartrace.Placement(placements, (2, 2), (3, 1, 0, 2), (8, 8))
        _same_bits(placement.assemble(pieces(first, second).__getitem__), whole, str(placement))
    partial = vartrace.Placement(("Partial(sum)",), (2,), (0, 1), (8, 8))
    with pytest.raises(ValueError, match=r"cannot be assembled: Partial\(sum\): each rank holds"):
        partial.assemble(lambda rank: whole)
    records = vartrace.Trace([whole], [1], [0], [0])
    with pytest.raises(ValueError, match="recorded no DTensor"):
        vartrace.assemble(records, 1)
    records.placement = vartrace.Placement(("Shard(dim=1)",), (2,), (0, 1), (8, 8))
    with pytest.raises(KeyError, match="on rank 1"):
        vartrace.assemble(records, 1)


def _check_group_file(path: Path, results: list[dict], ranks: list[int]) -> None:
    """`path` holds, bit for bit, the records of `ranks` (each rank's ground truth) and
    no other rank's."""
    with vartrace.open(path) as run:
        for name in workers.GROUP_SITES:
            site = run[name if "." in name else f"{name}.forward"]
            assert sorted(set(site.ranks.tolist())) == ranks, (path, name)
            for rank in ranks:
                for step, want in enumerate(results[rank]["truth"][name], start=1):
                    _same_bits(site.get(step, rank=rank), want, f"{path.name} {name} {rank}")


def test_a_model_on_two_ranks_of_four_gathers_within_its_ddp_group(tmp_path: Path) -> None:
    """Gathers once used every rank: the model's gather paired with the idle ranks'
    barrier and all four hung.  Now the tracer gathers within DDP's process group."""
    results = _run_ok("tests._parallel_workers:model_on_two_of_four", 4, tmp_path, pg_timeout=30.0)
    _check_group_file(tmp_path / "pair.h5", results, [0, 1])


def test_two_data_parallel_groups_write_a_file_each(tmp_path: Path) -> None:
    """Each group's first rank writes its group's records, and only those: by DDP's
    process group, and by `group=` with asynchronous staging (a gloo group of the
    group's ranks, made by them alone)."""
    results = _run_ok(
        "tests._parallel_workers:two_data_parallel_groups", 4, tmp_path, pg_timeout=30.0
    )
    assert "gather='node' gathers within each node's ranks" in results[0]["refused"]
    for kind in ("ddp", "option"):
        found = [result[kind] for result in results]
        _check_group_file(tmp_path / f"{kind}0.h5", found, [0, 1])
        _check_group_file(tmp_path / f"{kind}1.h5", found, [2, 3])


def test_pipeline_schedules_without_an_optimizer_never_hang(tmp_path: Path) -> None:
    """Each microbatch's call of a stage is an iteration; its gather, on the training
    thread, once landed between the stage's forward and the send of its activations and
    both ranks died at the group's timeout."""
    pytest.importorskip("torch.distributed.pipelining")
    results = _run_ok("tests._parallel_workers:pipeline_schedules", 2, tmp_path, pg_timeout=30.0)
    for kind in ("gpipe", "1f1b"):
        for staging in ("sync", "async"):
            key = f"{kind}-{staging}"
            assert results[1][f"losses-{key}"] == results[1][f"untraced-{kind}"], key
            with vartrace.open(tmp_path / f"{key}.h5") as run:
                for name in workers.PIPE_SITES:
                    site = run[name]
                    for rank, found in enumerate(results):
                        want = found[f"truth-{key}"][name]  # and the shape inference's call
                        assert len(want) >= workers.STEPS * workers.MICROBATCHES
                        for step, value in enumerate(want, start=1):
                            _same_bits(site.get(step, rank=rank), value, f"{key} {name} {rank}")
    for kind in ("gpipe", "1f1b"):
        warned = " ".join(results[0][f"warnings-{kind}-sync"])
        assert "runs inside a torch.distributed.pipelining schedule" in warned


def test_join_with_uneven_inputs_never_hangs(tmp_path: Path) -> None:
    """Gathers once paired with Join's shadow collectives and no rank left.  Under a
    Join built after the tracer started, the gathers wait for the tracer's stop; a
    tracer started inside a Join is refused at its start, naming the fixes."""
    results = _run_ok("tests._parallel_workers:join_uneven_inputs", 2, tmp_path, pg_timeout=30.0)
    for staging in ("sync", "async"):
        with vartrace.open(tmp_path / f"join-{staging}.h5") as run:
            for rank, found in enumerate(results):
                assert found[f"losses-{staging}"] == found["untraced"]
                for name in ("forward.x", "a.weight"):
                    for step, want in enumerate(found[f"truth-{staging}"][name], start=1):
                        _same_bits(run[name].get(step, rank=rank), want, f"{staging} {name}")
            assert len(run["forward.x"].ranks) == 2 + workers.STEPS + 2
    # on the training thread, every hand-over inside the Join holds back; a staging thread
    # that reaches a hand-over once the Join is over gathers it (no warning then)
    warned = " ".join(results[0]["warnings-sync"])
    assert "a torch.distributed.algorithms.Join shadows the collectives" in warned
    for found in results:
        assert "start the tracer first and build the Join inside it" in found["refused"]
        assert "gather=False" in found["refused"]


def test_fsdp2_parameter_records_are_the_unsharded_compute_copy_and_its_gradient(
    tmp_path: Path,
) -> None:
    """What docs/distributed.md says FSDP2 records: a parameter's value is the unsharded
    bf16 copy the forward computes with; its `@grad`, once that copy's gradient before
    the reduce-scatter (issue 44: not the `.grad` the docs promise), is now the sharded
    fp32 `.grad` the optimizer uses, each rank's shard bit for bit."""
    pytest.importorskip("torch.distributed.fsdp")
    results = _run_ok("tests._parallel_workers:fsdp2_bf16", 2, tmp_path, pg_timeout=30.0)
    records = results[0]["records"]
    values, grads = records["a.weight"], records["a.weight@grad"]
    for step in range(1, workers.STEPS + 1):
        for rank, found in enumerate(results):
            tags = zip(values.iterations, values.ranks, strict=True)
            last = [i for i, (it, r) in enumerate(tags) if it == step and r == rank][-1]
            full = found["truth"]["full"][step - 1].bfloat16()
            _same_bits(values.values[last], full, f"a.weight {step} {rank}")
        mine = [grads.values[i] for i, it in enumerate(grads.iterations) if it == step]
        assert [(g.shape, g.dtype) for g in mine] == [((4, 4), torch.float32)] * 2
        for rank, found in enumerate(results):
            tags = zip(grads.iterations, grads.ranks, strict=True)
            (row,) = [i for i, (it, r) in enumerate(tags) if it == step and r == rank]
            sharded = found["truth"]["sharded_grad"][step - 1]
            _same_bits(grads.values[row], sharded, f"a.weight@grad {step} {rank}")


def test_fsdp2_parameter_grad_is_the_sharded_grad_the_optimizer_uses(tmp_path: Path) -> None:
    """A parameter's `@grad` under FSDP2 was the unsharded bf16 gradient before the
    reduce-scatter; now it is the sharded fp32 `.grad` the optimizer uses (bit for bit
    each rank's `p.grad.to_local()`, read before `optimizer.step()`), under activation
    checkpointing (non-reentrant and reentrant) and a bf16 policy, and its placement joins
    the ranks' records into `p.grad.full_tensor()`."""
    pytest.importorskip("torch.distributed.fsdp")
    results = _run_ok("tests._parallel_workers:fsdp2_sharded_grad", 2, tmp_path, pg_timeout=30.0)
    for staging in ("sync", "async", "reentrant"):
        with vartrace.open(tmp_path / f"fsdp2-{staging}.h5") as run:
            for rank, found in enumerate(results):
                untraced = found["untraced-reentrant" if staging == "reentrant" else "untraced"]
                assert found[f"losses-{staging}"] == untraced
                truth = found[f"truth-{staging}"]
                for name in workers.FSDP_GRADS:
                    site = run[f"{name}@grad"]
                    assert len(site.calls(1, rank=rank)) == 1, (name, rank)
                    for step, want in enumerate(truth[f"{name}@grad"], start=1):
                        where = f"{staging} {name}@grad rank {rank} iteration {step}"
                        assert want.dtype == torch.float32
                        _same_bits(site.get(step, rank=rank), want, where)
                        whole = truth[f"{name}@grad whole"][step - 1]
                        _same_bits(vartrace.assemble(site, step), whole, f"whole {where}")
            assert run["a.weight@grad"].placement.placements == ("Shard(dim=0)",)


def test_fsdp2_internals_it_cannot_read_never_break_the_step() -> None:
    """The sharded parameters are found through FSDP2's private state; a torch whose state
    reads otherwise gives the unsharded copy's gradient, with a warning saying so (kept
    past the step under `-W error`: raised at the stop), never an error in the step."""
    pytest.importorskip("torch.distributed.fsdp")

    class _OtherFSDP(torch.nn.Linear):
        def _get_fsdp_state(self) -> None:
            raise AttributeError("'FSDPState' object has no attribute '_fsdp_param_groups'")

    torch.manual_seed(0)
    model = _OtherFSDP(4, 2)
    tracer = vartrace.ModelTracer(model, ["weight@grad"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning waits for the stop, after the step
        looked_up = "sharded parameters could not be looked up"
        with pytest.raises(RuntimeWarning, match=looked_up), tracer:
            model(torch.ones(3, 4)).sum().backward()
    _same_bits(tracer.results["weight@grad"].values[0], model.weight.grad, "weight@grad")


def _changes(values: list[torch.Tensor]) -> int:
    """The records change detection keeps of `values`: each that differs from the last."""
    return sum(i == 0 or not torch.equal(v, values[i - 1]) for i, v in enumerate(values))


def _held_in_memory(held: tuple[list[int], int], sites: int, records: int) -> None:
    """Each chunk held back took one interval's records (one a site), and the records
    alive at once stayed a few while `records` were recorded."""
    chunks, most_alive = held
    assert chunks and max(chunks) == 1, chunks
    assert most_alive <= 2 * sites < records, (most_alive, records)


def test_pipeline_schedules_hold_their_records_back_in_bounded_memory(tmp_path: Path) -> None:
    """Held-back gathers once kept every record in memory until the tracer stopped; now
    each held chunk goes to a file of its rank's, and the final gathers read them back:
    the saver's file holds every microbatch's records, bit for bit, and the losses are
    the untraced run's."""
    pytest.importorskip("torch.distributed.pipelining")
    results = _run_ok("tests._parallel_workers:pipeline_held_back", 2, tmp_path, pg_timeout=30.0)
    calls = workers.HELD_STEPS * workers.HELD_MICROBATCHES
    for kind in ("gpipe", "1f1b"):
        assert results[1][f"losses-{kind}"] == results[1][f"untraced-{kind}"], kind
        with vartrace.open(tmp_path / f"held-{kind}.h5") as run:
            for name in workers.PIPE_SITES:
                site = run[name]
                for rank, found in enumerate(results):
                    want = found[f"truth-{kind}"][name]
                    assert len(want) >= calls
                    kept = site.ranks.tolist().count(rank)
                    assert kept == _changes(want), (kind, name, rank)
                    for step, value in enumerate(want, start=1):
                        _same_bits(site.get(step, rank=rank), value, f"{kind} {name} {rank}")
        for found in results:
            _held_in_memory(found[f"held-{kind}"], len(workers.PIPE_SITES), 2 * calls)
            assert "in a temporary file of its own" in " ".join(found[f"warnings-{kind}"])


def test_join_holds_records_back_until_it_is_over(tmp_path: Path) -> None:
    """Under a Join of uneven inputs the records once piled up in memory, and the
    gathers stayed held back after the Join (torch never marks one over); a tracer
    started after a Join was refused.  Now the held records wait in a file, the gathers
    go on once the Join is over, and a tracer after a Join (kept by a name) starts."""
    results = _run_ok("tests._parallel_workers:join_held_back", 2, tmp_path, pg_timeout=30.0)
    steps = [count + workers.AFTER_JOIN for count in workers.JOIN_STEPS]
    with vartrace.open(tmp_path / "join-held.h5") as run:
        assert sorted(run["forward.x"].ranks.tolist()) == [0] * steps[0] + [1] * steps[1]
        for rank, found in enumerate(results):
            assert run["a.weight"].ranks.tolist().count(rank) == _changes(
                found["truth"]["a.weight"]
            )
        for rank, found in enumerate(results):
            assert found["losses"] == found["untraced"]
            for name in ("forward.x", "a.weight"):
                want = found["truth"][name]
                assert len(want) == steps[rank]
                for step, value in enumerate(want, start=1):
                    _same_bits(run[name].get(step, rank=rank), value, f"{name} {rank}")
    for found in results:
        _held_in_memory(found["held"], 2, 2 * max(workers.JOIN_STEPS))
    # rank 0 saved records while the steps past the Join ran, then the held ones at the stop
    assert "after" in results[0]["gathered_in"], results[0]["gathered_in"]
    assert results[0]["gathered_in"][-1] == "stop"
    with vartrace.open(tmp_path / "join-every-other.h5") as run:
        for rank, found in enumerate(results):
            every = found["every-other"]
            assert every["losses"] == every["untraced"]
            for step, value in enumerate(every["truth"]["forward.x"], start=1):
                _same_bits(run["forward.x"].get(step, rank=rank), value, f"every other {rank}")
        warned = " ".join(results[0]["warnings-every-other"])
        assert "the ranks' iteration counts may differ" in warned
    with vartrace.open(tmp_path / "after-join.h5") as run:
        for rank, found in enumerate(results):
            assert found["losses-after"] == found["untraced-after"]
            assert not [w for w in found["warnings-after"] if "Join" in w]
            for name in ("forward.x", "a.weight"):
                want = found["truth-after"][name]
                assert len(want) == workers.STEPS
                for step, value in enumerate(want, start=1):
                    _same_bits(run[name].get(step, rank=rank), value, f"after {name} {rank}")


def test_held_chunks_come_back_from_their_file_bit_for_bit() -> None:
    """What a rank holds back is written as a gather packs it, and read back one chunk at
    a time, oldest first: tensors of any dtype (large ones apart from the rest), numpy
    arrays, Python leaves and stacked traces, with their tags.  A chunk that cannot be
    written (a record that does not pickle) leaves the file as it was."""
    large = torch.arange(2**17, dtype=torch.float32) - 0.5  # 512 KiB: a message of its own
    first = {
        "forward.x": vartrace.Trace(
            [torch.tensor([1.5, -0.0]).bfloat16(), large, np.arange(3, dtype=np.int16), 7, "s"],
            [1, 2, 3, 4, 5],
            [1, 1, 1, 1, 1],
            [1, 2, 3, 4, 5],
        ),
        "stacked": vartrace.Trace(torch.ones(2, 3), [1, 2], [1, 1], [6, 7]),
    }
    vartrace.stack_tensors("stacked", first["stacked"])
    second = {
        "forward.x": vartrace.Trace(
            [None, torch.zeros(2, dtype=torch.bool)], [6, 7], [1, 1], [8, 9]
        )
    }
    spill = Spill()
    spill.put(first)
    with pytest.raises(Exception, match=r"lambda|pickle"):
        spill.put({"bad": vartrace.Trace([lambda: 0], [8], [1], [10])})
    spill.put(second)
    back = list(spill.chunks())
    assert [list(chunk) for chunk in back] == [["forward.x", "stacked"], ["forward.x"]]
    for want, got in zip((first, second), back, strict=True):
        for name, trace in want.items():
            found = got[name]
            for tags in ("iterations", "ranks", "order"):
                assert list(map(int, getattr(found, tags))) == list(map(int, getattr(trace, tags)))
            if isinstance(trace.values, torch.Tensor):
                _assert_same_value(found.values, trace.values, name)
                continue
            for i, value in enumerate(trace.values):
                _assert_same_value(found.values[i], value, f"{name}[{i}]")
    assert list(spill.chunks()) == []


def test_a_join_is_live_in_its_body_and_its_exit_and_over_after(tmp_path: Path) -> None:
    """torch keeps a joinable's Join setting after the Join; `join_live` tells the phases
    apart: live in the body and in `__exit__` (where a rank out of inputs shadows the
    others), over after, also for a Join kept by a name and entered twice."""
    (found,) = _run_ok("tests._parallel_workers:join_phases", 1, tmp_path)
    for phase, live in found["seen"]:
        assert live == (phase in ("body", "exit")), found["seen"]
    assert [phase for phase, _ in found["seen"]].count("exit") == 4
