"""HTML for a notebook's rich display (`_repr_html_`): a title and tables, every text escaped.

Every string goes through `html.escape`: site names, file paths and attributes come from
files and models that anyone may have written.

Example:
    ```python
    block("Run run.h5", [("state", "finished")], head=("site", "records"), rows=[("x", 3)])
    ```
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape

__all__ = ["block"]


def _cells(tag: str, values: Iterable[object]) -> str:
    return "".join(f"<{tag}>{escape(str(value))}</{tag}>" for value in values)


def block(
    title: str,
    facts: Sequence[tuple[str, object]] = (),
    *,
    head: Sequence[str] = (),
    rows: Iterable[Sequence[object]] = (),
    more: int = 0,
) -> str:
    """A bold `title`, a list of `(name, value)` facts (`name: value`, or the value alone
    where `name` is empty), then a table of `rows` under
    `head` (none without `head`), and `"... and N more"` where `more` rows were left out."""
    parts = [f"<div><strong>{escape(title)}</strong>"]
    if facts:
        items = "".join(
            f"<li>{escape(f'{name}: {value}' if name else str(value))}</li>"
            for name, value in facts
        )
        parts.append(f"<ul>{items}</ul>")
    if head:
        body = "".join(f"<tr>{_cells('td', row)}</tr>" for row in rows)
        parts.append(f"<table><thead><tr>{_cells('th', head)}</tr></thead>")
        parts.append(f"<tbody>{body}</tbody></table>")
    if more:
        parts.append(f"<p>... and {more} more</p>")
    parts.append("</div>")
    return "".join(parts)
