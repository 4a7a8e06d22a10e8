"""Saying why a pattern recorded nothing, once, when a tracer stops.

Patterns are checked statically before the first step, but some can only
fail at run time: a local that is never bound on the path the model takes
(nanoGPT's `att` when it uses scaled-dot-product attention), a value that
is always `None` (Hugging Face's `attn_weights` under SDPA), a method
that is never called, a key below a return value that the run does not
have, a method the program replaced on its module while traced (with one
that does not call the patched method), or a model that only ran in a mode
the tracer does not trace.  A
`SilenceWatch` notes what each patched method and each site saw,
and `SilenceWatch.report` warns once per pattern that recorded
nothing (or only `None`), saying which of these applies.

Example:
    ```python
    with ModelTracer(model, ["layers.*.attn.forward.att"]) as tracer:
        model(x)
    # UserWarning: vartrace: pattern 'layers.*.attn.forward.att' recorded nothing:
    # the variable or key was never bound when its method returned ...
    ```
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Sequence
from types import CodeType
from typing import Any

from torch import nn

from vartrace._support.warnings import warn
from vartrace.engine.code import CALLEE_SEPARATOR
from vartrace.engine.paths import LINE_MARK, parse
from vartrace.tracing.sites import Target

__all__ = ["SilenceWatch"]

_ABSENT = object()
_FX_FILE = "<eval_with_key>"  # the file name of the code torch.fx generates (GraphModule)


class SilenceWatch:
    """What the patched methods of one tracer saw, to explain patterns that recorded nothing."""

    def __init__(self, targets: Sequence[Target], mode: str, root: object) -> None:
        self._targets = list(targets)
        self._root = root
        self._mode = mode
        # The sites that captured a leaf other than None, and None: `saw` adds to them
        # (the tracer's record path adds to them itself, without the call).
        self.values: set[str] = set()
        self.nones: set[str] = set()
        # What each traced module's __dict__ holds under the method's name before the
        # tracer patches it (usually nothing: the class's method).
        self._held = {id(t): vars(t.module).get(t.method.name, _ABSENT) for t in self._targets}

    def saw(self, site: str, value: Any) -> None:
        """Note a captured leaf (`None` counts apart)."""
        (self.nones if value is None else self.values).add(site)

    def _seen(self, sites: set[str], names: set[str], line: int | None) -> bool:
        """Whether one of `names` is a leaf of one of `sites`; for a pattern naming a
        `line` (`scores@every:L73`), one bound at that line."""
        binding = None if line is None else _binding(line)
        return any(
            (name == site or name.startswith((f"{site}.", f"{site}@")))
            and (binding is None or binding.search(name) is not None)
            for name in names
            for site in sites
        )

    def report(self, in_mode: bool, other_calls: int, called: Sequence[Target]) -> None:
        """Warn once per pattern that recorded nothing, or once for a mode that never ran.

        `in_mode` says whether any outermost model call ran in the traced
        mode; `other_calls` counts those that ran in the other one;
        `called` lists the targets whose patched method was called.  A tracer
        during which the model never ran says nothing.  Call it once the
        patches are removed.
        """
        called_ids = {id(target) for target in called}
        replaced = self._replaced(called_ids)
        patterns: dict[str, tuple[set[str], list[Target]]] = {}
        for target in self._targets:
            for text, names in target.origins.items():
                entry = patterns.setdefault(text, (set(), []))
                entry[0].update(names)
                entry[1].append(target)
        if not patterns or not (in_mode or other_calls or called_ids):
            return  # the model never ran while the tracer was active
        if not in_mode and other_calls and not (self.values or self.nones):
            other = "eval" if self._mode == "train" else "train"
            warn(
                f"vartrace: recorded nothing: the model ran {other_calls} time(s), only in "
                f"{other} mode, and this tracer has mode={self._mode!r}; pass "
                f"mode={other!r} or mode='any' (patterns: {', '.join(map(repr, patterns))})",
                UserWarning,
                stacklevel=4,
            )
            return
        if in_mode:
            root = self._root
            called_ids.update(
                id(t) for t in self._targets if t.module is root and t.method.name == "forward"
            )
        for text, (sites, targets) in patterns.items():
            missing = {site for t in targets for site in t.missing_keys()}
            pattern = parse(text)
            line = pattern.line
            if self._seen(sites, self.values, line) or sites <= missing:
                continue  # recorded, or said at the first return
            suffix = f"@{pattern.when}" if pattern.when else ""
            why = self._why(sites, targets, called_ids, replaced, line, suffix)
            warn(
                f"vartrace: pattern {text!r} recorded nothing: {why}",
                UserWarning,
                stacklevel=4,
            )

    def after_first_iteration(self, called: Sequence[Target]) -> None:
        """Warn once per pattern none of whose methods ran in the first traced iteration:
        known as early as that, and said again by `report` if they never run."""
        called_ids = {id(target) for target in called}
        patterns: dict[str, list[Target]] = {}
        for target in self._targets:
            for text in target.origins:
                patterns.setdefault(text, []).append(target)
        for text, targets in patterns.items():
            if any(id(t) in called_ids for t in targets) or any(
                t.module is self._root and t.method.name == "forward" for t in targets
            ):
                continue
            methods = ", ".join(sorted({f"{t.path or '<root>'}.{t.method.name}" for t in targets}))
            warn(
                f"vartrace: pattern {text!r} recorded nothing in iteration 1: its method was "
                f"not called ({methods}); it may run only in eval or in later iterations, "
                "and vartrace says so again at exit if it never does",
                UserWarning,
                stacklevel=4,
            )

    def _replaced(self, called_ids: set[int]) -> list[Target]:
        """The targets whose method the program replaced on the module while traced, with
        one that never called the patched method."""
        return [
            t
            for t in self._targets
            if id(t) not in called_ids
            and vars(t.module).get(t.method.name, _ABSENT) is not self._held[id(t)]
        ]

    def _why(
        self,
        sites: set[str],
        targets: list[Target],
        called_ids: set[int],
        replaced: list[Target],
        line: int | None,
        suffix: str,
    ) -> str:
        if self._seen(sites, self.nones, line):
            if any(t.method.code.co_filename.startswith(_FX_FILE) for t in targets):
                return (
                    "its value was None at every call: torch.fx's generated code frees each "
                    "value after its last use (`x = None`), so a local is None when the method "
                    "returns; record it as it is assigned, with @every (e.g. "
                    f"'{sorted(sites)[0]}@every')"
                )
            return "its value was None at every call (e.g. attention weights under SDPA)"
        lost = [t for t in replaced if any(t is target for target in targets)]
        if lost:
            t = lost[0]
            where = f"{t.path or '<root>'}.{t.method.name}"
            return (
                f"{where} was replaced on the module after the tracer started (by "
                f"{_described(vars(t.module).get(t.method.name))}), and the new one never "
                "called the method vartrace patched; start the tracer after the code "
                f"that replaces {t.method.name} (after accelerator.prepare(model), or create "
                "the Trainer first)"
            )
        if not any(id(t) in called_ids for t in targets):
            methods = ", ".join(sorted({f"{t.path or '<root>'}.{t.method.name}" for t in targets}))
            return f"its method was never called ({methods})" + self._parameter_hint(sites, suffix)
        functions = {
            name: (ran.ran[0], target)
            for target in targets
            for name, ran in target.functions.items()
            if any(site == name or site.startswith(f"{name}.") for site in sites)
        }
        if functions and not any(ran for ran, _ in functions.values()):
            passed = sorted(name for name, (_, t) in functions.items() if _passed_on(name, t))
            if passed:
                method = passed[0].partition(CALLEE_SEPARATOR)[0]
                function = passed[0].partition(CALLEE_SEPARATOR)[2]
                return (
                    f"{method} never calls {function} itself: it only passes it on (as an "
                    f"argument: FlexAttention's score_mod), and the function that calls it "
                    "runs it where vartrace does not read its frames (not called straight "
                    f"from {method}: under torch.compile, torch.func.vmap, a library's "
                    f"loop); record what that call returns, or call {function} from "
                    f"{method.rpartition('.')[2]} itself"
                )
            return f"the function it is in was never called ({', '.join(sorted(functions))})"
        for t in targets:
            code = _other_code(self._held[id(t)], t)
            if code is None:
                continue
            name = getattr(code, "co_qualname", code.co_name)
            return (
                f"{t.path or '<root>'}.{t.method.name} is the function {name} "
                f"({code.co_filename}:{code.co_firstlineno}), set on the module before the "
                "tracer started (TRL's fused LM head): vartrace reads the variables of the "
                f"class's {type(t.module).__name__}.{t.method.name}, which that function may "
                f"call on some paths only; record what it returns "
                f"('{_join(t.path, t.method.name)}' and its keys) or the sites of the modules "
                "it calls"
            )
        if line is not None:
            return (
                f"line {line} bound no value of it in any call (@every keys a value by the "
                "line of the statement that bound it or changed it in place); drop "
                f"{LINE_MARK}{line} to see the lines that do"
            )
        return (
            "the variable was never bound when its method (or function) returned, or the key "
            "was not in the value (a branch the run did not take)"
        )

    def _parameter_hint(self, sites: set[str], suffix: str) -> str:
        """For parameters of modules never called, how to reach them from the root's
        `forward` (code may use a module's weight without calling it); `suffix` is the
        pattern's timing (`@grad`)."""
        if not isinstance(self._root, nn.Module):
            return ""
        parameters = dict(self._root.named_parameters())
        used = sorted(site for site in sites if site in parameters)
        if not used:
            return ""
        return (
            f": a parameter is read when its module's forward is entered; where the code uses "
            f"{used[0]} without calling its module (TRL's fused LM head reads lm_head.weight), "
            f"name it through the model's forward instead: 'forward.self.{used[0]}{suffix}'"
        )


def _passed_on(called: str, target: Target) -> bool:
    """Whether the method of `target` only passes the function of `called`
    (`attn.forward>rel_bias`) on: as an argument of a call, never called by its name
    (nor bound to a local, HF's `attention_interface = eager_attention_forward`)."""
    name = called.rpartition(CALLEE_SEPARATOR)[2]
    function = target.method.function
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):  # no source: nothing to tell
        return False
    passed = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == name:
                return False
            values = [*node.args, *(keyword.value for keyword in node.keywords)]
            passed |= any(isinstance(v, ast.Name) and v.id == name for v in values)
    return passed


def _binding(line: int) -> re.Pattern[str]:
    """What finds the mark of the values bound at `line` in a site name (`@every:L73`, at
    its end or before the keys of an object split into leaves)."""
    return re.compile(rf"@every{re.escape(LINE_MARK)}{line}(?:\.|$)")


def _other_code(held: object, target: Target) -> CodeType | None:
    """The code of `held`, what the module held under the target's method name before the
    tracer patched it, where it is not the code of the method vartrace reads."""
    code = getattr(getattr(held, "__func__", held), "__code__", None)
    return code if isinstance(code, CodeType) and code is not target.method.code else None


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _described(held: object) -> str:
    """What a module's `__dict__` holds in place of a traced method, for a warning."""
    if held is None:
        return "nothing: the class's method"
    function = getattr(held, "__func__", held)
    name = getattr(function, "__qualname__", None) or type(held).__name__
    return f"a method bound to {name}" if function is not held else name
