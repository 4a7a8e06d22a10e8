"""The two markers of the record path: `Unstored` (a value vartrace could not keep) and
`DROP` (a pre-save callback's "do not keep this record").

A leaf importing nothing: the torch-free engine marks references back into a walked
structure with `Unstored`, and the tracer, the saver and the readers use both.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DROP", "Unstored"]


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


class _Drop:
    __slots__ = ()

    def __repr__(self) -> str:
        return "vartrace.DROP"


DROP: Final = _Drop()
"""Return this from a pre-save callback to drop the record.  Example:

```python
def skip_small(name, trace):
    return vartrace.DROP if trace[0].numel() < 16 else trace
```
"""
