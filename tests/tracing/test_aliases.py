"""Every name a `**` pattern matched can be read back (issue 32 item 0).

A tensor handed from one method to another is stored once; the other names that
held it are aliases of the stored site, in memory and in the file.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import vartrace
from tests._hf_shapes import LlamaLike, MoeLike, tokens
from vartrace import H5PYSaverCallback, ModelTracer

EAGER = "layers.{}.self_attn.forward>eager_attention_forward.attn_weights"
FORWARD = "layers.{}.self_attn.forward.attn_weights"


class Block(nn.Module):
    """A block whose `forward` computes `scores` and hands them to a helper method."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1)
        return self._attend(scores, x)

    def _attend(self, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return scores.softmax(-1) @ v


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_eager_attention_weights_read_under_the_attention_forward_too() -> None:
    model = LlamaLike()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["**.attn_weights"]) as tracer:
            for step in range(3):
                model(tokens(step))
    results = tracer.results
    assert results.stored == [EAGER.format(0), EAGER.format(1)]  # stored once
    assert results.aliases == {FORWARD.format(i): EAGER.format(i) for i in range(2)}
    assert sorted(results) == sorted([EAGER.format(0), EAGER.format(1), *results.aliases])
    for layer in range(2):
        alias, stored = results[FORWARD.format(layer)], results[EAGER.format(layer)]
        assert alias is stored
        assert list(alias.iterations) == [1, 2, 3]
    frame = results.to_frame()
    assert set(frame["site"]) == set(results)


def test_a_site_another_pattern_stored_first_still_claims_its_tensor() -> None:
    # Found tracing TRL's SFTTrainer: the function's site named alone before `**` stored
    # the weights twice, once more under the attention's forward.
    model = LlamaLike()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, [EAGER.format("*"), "**.attn_weights"]) as tracer:
            model(tokens(0))
    assert tracer.results.stored == [EAGER.format(0), EAGER.format(1)]
    assert tracer.results.aliases == {FORWARD.format(i): EAGER.format(i) for i in range(2)}


def test_a_local_handed_to_a_helper_reads_where_it_was_computed() -> None:
    model = TwoBlocks()
    x = torch.randn(2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["**.scores"]) as tracer:
            model(x)
    block = model.blocks[0]
    expected = block.q(x) @ block.k(x).transpose(-2, -1)
    scores = tracer.results["blocks.0.forward.scores"]  # KeyError before aliases
    torch.testing.assert_close(scores.values[0], expected)
    assert tracer.results.aliases == {
        f"blocks.{i}.forward.scores": f"blocks.{i}._attend.scores" for i in range(2)
    }


def test_router_logits_handed_up_read_under_every_name() -> None:
    model = MoeLike()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["**.router_logits"], change_detection=False) as tracer:
            out = model(tokens(0))
    gate = "model.layers.{}.gate.forward.router_logits"
    assert tracer.results.stored == [gate.format(0), gate.format(1)]
    for layer in range(2):
        for name in (
            f"model.layers.{layer}.forward.router_logits",
            f"model.forward.router_logits.{layer}",
            f"forward.router_logits.{layer}",
        ):
            assert tracer.results.aliases[name] == gate.format(layer)
            torch.testing.assert_close(tracer.results[name].values[0], out.router_logits[layer])


def test_aliases_are_in_the_file_and_every_reader_knows_them(tmp_path: Path) -> None:
    model = LlamaLike()
    path = tmp_path / "run.h5"
    with ModelTracer(model, ["**.attn_weights"], post_gather_callbacks=[H5PYSaverCallback(path)]):
        for step in range(3):
            model(tokens(step))
    with vartrace.open(path) as run:
        assert run.aliases == {FORWARD.format(i): EAGER.format(i) for i in range(2)}
        assert {FORWARD.format(0), EAGER.format(0)} <= set(run.names)
        alias, stored = run[FORWARD.format(0)], run[EAGER.format(0)]
        assert alias.name == FORWARD.format(0)
        assert list(alias.iterations) == list(stored.iterations) == [1, 2, 3]
        for iteration in (1, 2, 3):
            assert torch.equal(
                torch.as_tensor(alias.get(iteration)), torch.as_tensor(stored.get(iteration))
            )


def test_an_alias_whose_value_parts_ways_stores_its_own_and_says_so() -> None:
    class Sometimes(nn.Module):
        """Hands `h` to a helper on even calls, a changed copy on odd ones."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            self.calls += 1
            return self._post(h if self.calls % 2 else h * 2)

        def _post(self, h: torch.Tensor) -> torch.Tensor:
            return h.relu()

    model = Sometimes()
    with ModelTracer(model, ["**.h"], change_detection=False) as tracer:
        model(torch.randn(2, 4))  # forward.h is an alias of _post.h
        assert tracer.results.aliases == {"forward.h": "_post.h"}
        with pytest.warns(UserWarning, match="forward.h held the same tensor as _post.h"):
            model(torch.randn(2, 4))  # _post gets h * 2: forward.h holds a value of its own
    assert "forward.h" in tracer.results.stored
    assert tracer.results.aliases == {}
    assert list(tracer.results["forward.h"].iterations) == [2]
    assert list(tracer.results["_post.h"].iterations) == [1, 2]


def test_the_command_line_lists_aliases_and_shows_them(tmp_path: Path) -> None:
    from tests.cli.test_cli import vartrace as run_cli

    model = LlamaLike()
    path = tmp_path / "run.h5"
    with ModelTracer(model, ["**.attn_weights"], post_gather_callbacks=[H5PYSaverCallback(path)]):
        for step in range(2):
            model(tokens(step))
    listed = run_cli("ls", path)
    assert listed.returncode == 0, listed.stderr
    assert ": 2 sites, 4 records" in listed.stdout and "; 2 aliases" in listed.stdout
    (row,) = [line.split() for line in listed.stdout.splitlines() if line.endswith(" alias")][:1]
    assert row[0] == FORWARD.format(0) and row[1] == "2"  # the records it reads as
    assert f"  {FORWARD.format(0)} -> {EAGER.format(0)}" in listed.stdout
    shown = run_cli("show", path, FORWARD.format(1), "--iteration", "2")
    assert shown.returncode == 0, shown.stderr
    assert FORWARD.format(1) in shown.stdout


def test_compare_compares_an_alias_once_under_the_site_that_stored_it(tmp_path: Path) -> None:
    paths = [tmp_path / "a.h5", tmp_path / "b.h5"]
    for path, shift in zip(paths, (0.0, 1.0), strict=True):
        torch.manual_seed(0)
        model = LlamaLike()
        if shift:
            with torch.no_grad():
                model.layers[1].self_attn.q_proj.weight.mul_(1 + shift)
        with ModelTracer(
            model, ["**.attn_weights"], post_gather_callbacks=[H5PYSaverCallback(path)]
        ):
            model(tokens(0))
    report = vartrace.compare(*paths)
    compared = {summary.site for summary in report.sites}
    assert compared == {EAGER.format(0), EAGER.format(1)}  # not the aliases again
    assert report.first_divergence is not None
    assert report.first_divergence.site == EAGER.format(1)
    alone = vartrace.compare(*paths, names=FORWARD.format(1))  # an alias named: compared
    assert [summary.site for summary in alone.sites] == [FORWARD.format(1)]
    assert not alone.ok
