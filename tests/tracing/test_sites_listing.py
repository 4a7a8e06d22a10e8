"""``list_sites`` lists the model's own methods, not torch's helpers, unless named literally."""

from __future__ import annotations

import torch
from torch import nn

import vartrace
from vartrace.tracing.sites import resolve


class Block(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._scaled(super().forward(x))

    def _scaled(self, y: torch.Tensor) -> torch.Tensor:
        factor = 2.0
        return y * factor


def test_list_sites_leaves_out_torch_helper_methods_unless_named() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Conv2d(1, 1, 1), Block(2, 2))
    sites = vartrace.list_sites(model)
    for helper in ("reset_parameters", "extra_repr", "_conv_forward", "append", "insert"):
        assert not any(helper in site.split(".") for site in sites), helper
    assert {"0.forward.input", "1.forward.input", "2._scaled.factor", "2.forward"} <= set(sites)
    assert vartrace.list_sites(model, "0.reset_parameters") == ["0.reset_parameters"]
    assert "1._conv_forward.weight" in vartrace.list_sites(model, "*._conv_forward.*")
    named = vartrace.list_sites(model, "*.reset_parameters")
    assert {"0.reset_parameters", "1.reset_parameters"} <= set(named)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_wildcards_skip_the_helpers_of_torch_containers_unless_named() -> None:
    model = Stack()
    targets = resolve(model, ["layers.*"])
    assert sorted((t.path, t.method.name) for t in targets) == [
        ("layers.0", "forward"),
        ("layers.1", "forward"),
    ]
    assert not any("_get_abs_string_index" in s for s in vartrace.list_sites(model, "layers.*"))
    literal = resolve(model, ["layers._get_abs_string_index.idx"])
    assert [(t.path, t.method.name) for t in literal] == [("layers", "_get_abs_string_index")]
