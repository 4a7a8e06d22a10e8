"""How a tracer shows itself: a one-line repr (state, model, sites, records so far, where
it was started) and a table for a notebook's rich display.

Example:
    ```python
    tracer            # <ModelTracer running on GPT: 3 traced methods, 24 records, ...>
    tracer._repr_html_()
    ```
"""

from __future__ import annotations

from dataclasses import dataclass

from vartrace._support.html import block
from vartrace._support.text import size_text

__all__ = ["TracerSummary"]


@dataclass(frozen=True)
class TracerSummary:
    """What a tracer says of itself now."""

    state: str  # "not started", "running" or "stopped"
    model: str  # the model's class name
    methods: tuple[str, ...]  # the traced methods, `<path>.<method>`
    records: int  # records kept since the start
    held: int  # bytes of the records held in the chunk now
    where: str  # file:line of the start, "" before it

    def plain(self) -> str:
        count = len(self.methods)
        started = f", started at {self.where}" if self.where else ""
        return (
            f"<ModelTracer {self.state} on {self.model}: {count} traced "
            f"method{'' if count == 1 else 's'}, {self.records} records, "
            f"{size_text(self.held)} held{started}>"
        )

    def html(self) -> str:
        facts = [
            ("state", self.state),
            ("records so far", self.records),
            ("held in memory", size_text(self.held)),
        ]
        if self.where:
            facts.append(("started at", self.where))
        rows = [(method,) for method in self.methods]
        return block(f"ModelTracer on {self.model}", facts, head=("traced method",), rows=rows)
