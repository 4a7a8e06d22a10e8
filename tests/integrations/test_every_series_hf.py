"""A Hugging Face Llama's hidden state, rebound through its decoder blocks, read as one
`@every` series: every value `hidden_states` took in `LlamaModel.forward`, in order, is
what the embedding, each block and the final norm handed on (ground truth from forward
hooks on those modules).  Real transformers (skipped without it), random weights, a real
HDF5 file; `tests/tracing/test_every_series.py` is the small model of the same shape.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vartrace
from tests._hf import tiny_llama
from vartrace import H5PYSaverCallback, ModelTracer

pytest.importorskip("transformers")

SERIES = "model.forward.hidden_states@every"


def _handed_on(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[object]]:
    """The outputs of the embedding, each decoder block and the norm, as hooks see them."""
    seen: list[torch.Tensor] = []

    def keep(_: object, __: object, output: object) -> None:
        seen.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    modules = (model.model.embed_tokens, *model.model.layers, model.model.norm)
    return seen, [module.register_forward_hook(keep) for module in modules]


def test_the_hidden_state_through_the_blocks_reads_as_one_series(tmp_path: Path) -> None:
    model = tiny_llama()
    seen, hooks = _handed_on(model)
    path = tmp_path / "llama.h5"
    steps = [torch.tensor([[2, 5, 6, 7]]), torch.tensor([[2, 8, 9, 3]])]
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(model, [SERIES], post_gather_callbacks=[saver]) as tracer,
    ):
        for tokens in steps:
            model(tokens).logits.sum().backward()
    for hook in hooks:
        hook.remove()
    per_call = len(model.model.layers) + 2
    assert len(seen) == per_call * len(steps)
    with vartrace.open(path) as run:
        lines = run.series[SERIES]
        assert len(lines) == 3 and run.names == lines  # before, in and after the loop
        for name in (SERIES, "model.forward.hidden_states"):
            site = run[name]
            assert site.iterations.tolist() == [1] * per_call + [2] * per_call
            records = [site.record(i) for i in range(len(site))]
            assert all(torch.equal(a, b) for a, b in zip(records, seen, strict=True))
        assert torch.equal(run[SERIES].get(iteration=1), seen[per_call - 1])
    assert tracer.results.series == {}  # the saver took the records
