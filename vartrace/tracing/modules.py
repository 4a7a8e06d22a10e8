"""What a model is made of, as pattern resolution sees it: its modules (through DDP/FSDP
wrappers), their methods, and the parts it must not patch (scripted modules, fullgraph regions).

Example:
    ```python
    model = unwrap(ddp_model)            # the module DDP wraps
    methods = module_methods(model.attn)  # name -> MethodInfo, below torch.nn.Module
    ```
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Iterator
from functools import cache
from typing import Any

import torch
from torch import nn

from vartrace.engine.code import (
    MethodInfo,
    methods_of,
)
from vartrace.engine.paths import Pattern, is_glob
from vartrace.engine.structures import register_container
from vartrace.tracing.eager import dynamo_context

__all__ = ["fullgraph_regions", "is_compiled", "module_methods", "unwrap"]

_WRAPPER_NAMES = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def _module_children(module: nn.Module) -> Iterator[tuple[str, object]]:
    # A parameter or buffer slot set to None (``bias=False``) is no value: skip it quietly.
    yield from ((k, v) for k, v in module._parameters.items() if v is not None)
    yield from ((k, v) for k, v in module._buffers.items() if v is not None)
    yield from module._modules.items()


register_container(nn.Module, _module_children)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel / FSDP / `torch.compile` wrappers.

    Example:
        ```python
        unwrap(DistributedDataParallel(net)) is net   # True
        ```
    """
    while True:
        if type(model).__name__ in _WRAPPER_NAMES and isinstance(
            getattr(model, "module", None), nn.Module
        ):
            model = typing.cast(nn.Module, model.module)
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = typing.cast(nn.Module, model._orig_mod)  # torch.compile's OptimizedModule
        else:
            return model


def without_scripted(
    modules: list[tuple[str, nn.Module]],
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """`modules` without the `torch.jit` script or traced modules and what lies below
    them (their code runs in TorchScript, outside Python), and those modules themselves."""
    kept: list[tuple[str, nn.Module]] = []
    scripted: list[tuple[str, nn.Module]] = []
    for path, module in modules:
        if any(path == top or path.startswith(f"{top}.") or not top for top, _ in scripted):
            continue
        (scripted if isinstance(module, torch.jit.ScriptModule) else kept).append((path, module))
    return kept, scripted


def scripted_refusal(pattern: Pattern, scripted: list[tuple[str, nn.Module]]) -> str | None:
    """Why `pattern` cannot be traced, if it names a site inside a scripted module."""
    for path, module in scripted:
        states = pattern.start
        for segment in path.split(".") if path else ():
            states = pattern.step(states, segment, plain=True)
        if states and not is_glob(pattern.segments[0]):
            where = f"{path!r} is" if path else "the model is"
            return (
                f"pattern {pattern.text!r} names code inside a torch.jit module: {where} a "
                f"{type(module).__name__}, whose code TorchScript runs outside Python, where "
                "vartrace cannot see its values; trace the values the Python code around it "
                "passes in and gets back (the caller's locals), or keep the module "
                "unscripted while tracing"
            )
    return None


def is_compiled(model: nn.Module) -> bool:
    """Whether `model` or one of its submodules runs under `torch.compile`."""
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in unwrap(model).modules())


def _fullgraph(compiled: Any) -> bool:
    """Whether `compiled` (an `OptimizedModule` or a `torch.compile`d function) was
    compiled with `fullgraph=True`: its Dynamo context says so."""
    context = getattr(compiled, "dynamo_ctx", None)
    wrapping = dynamo_context()  # None: torch.compile was never called, nothing compiled
    if context is None and wrapping is not None and callable(compiled):
        for cell in getattr(compiled, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if isinstance(cell.cell_contents, wrapping):
                    context = cell.cell_contents
    return bool(getattr(context, "fullgraph", False))


def fullgraph_regions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of `model` that run under `torch.compile(..., fullgraph=True)`, by
    path: compiled in place (`module.compile(fullgraph=True)`) or wrapped and assigned
    back (`torch.compile(block, fullgraph=True)`: the wrapper's `_orig_mod`).

    Example:
        ```python
        model.layers[0].compile(fullgraph=True)
        [path for path, _ in fullgraph_regions(model)]   # ['layers.0']
        ```
    """
    regions = []
    for path, module in model.named_modules():
        inner = getattr(module, "_orig_mod", None)
        if isinstance(inner, nn.Module) and _fullgraph(module):
            # The model itself compiled: its paths start below the wrapper (sites.unwrap).
            regions.append((f"{path}._orig_mod" if path else "", inner))
        elif _fullgraph(getattr(module, "_compiled_call_impl", None)):
            regions.append((path, module))
    return regions


def module_methods(module: nn.Module) -> dict[str, MethodInfo]:
    """The methods of a module's class that a pattern can name (those below nn.Module)."""
    return methods_of(type(module), nn.Module)  # type: ignore[arg-type]  # classes hash


def join_path(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _has_forward(module: nn.Module) -> bool:
    return "forward" in module_methods(module)


def torch_helper(module: nn.Module, name: str) -> bool:
    """Whether `name` is a helper method of torch's own (`_get_abs_string_index` of a
    `ModuleList`, `reset_parameters`, `_conv_forward`): a method other than
    `forward` that a class of the `torch` package defines.  Wildcards skip them; a
    literal name reaches them."""
    return name != "forward" and _defined_by_torch(type(module), name)  # type: ignore[arg-type]


@cache
def _defined_by_torch(cls: type, name: str) -> bool:
    owner = next(c for c in cls.__mro__ if name in vars(c))
    return owner.__module__.split(".")[0] == "torch"
