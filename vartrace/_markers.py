"""The marker a record holds where vartrace could not keep a value.

A module of its own, importing nothing: the torch-free engine marks references back
into a walked structure with it, and the tracer, the saver and the readers use it too,
without one importing the others.
"""

from __future__ import annotations

__all__ = ["Unstored"]


class Unstored(str):
    """A record that stands for a value vartrace could not keep: a text saying what and why.

    Where a captured value can be neither copied nor split into tensors, the
    tracer records this marker (with a warning naming the site); where the
    saver cannot store a record, it writes this marker instead of failing
    the step; a reference back into a structure being walked is one too.
    Reading a file gives it back.  Example:

    ```python
    value = run["forward.gen"].get(iteration=1)
    if isinstance(value, vartrace.Unstored):
        print(value)   # "generator: cannot pickle 'generator' object"
    ```
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"vartrace.Unstored({str.__repr__(self)})"
