"""What the command line prints: every line passes through `print_safe`, which shows control
and format characters escaped, so a crafted site name or path cannot act on the terminal,
and clips lines (and `table_lines` its cells), so a crafted string of a megabyte prints
as a line of a few thousand characters at most.

Example:
    ```python
    print_safe(f"no site {name!r}")
    ```
"""

from __future__ import annotations

import re
import sys
import unicodedata
from collections.abc import Sequence
from typing import Any, TextIO

from vartrace._support.text import clipped


class UserError(Exception):
    """An error whose message is the whole story (no exception type printed)."""


#: A character other than printable ASCII: shown as it is unless its category is hidden.
_NOT_ASCII_TEXT = re.compile(r"[^\x20-\x7e]")
#: Unicode categories a terminal may act on rather than show: controls (C0 such as ESC,
#: BEL, NUL, CR, backspace; DEL; C1), format characters (bidi overrides and isolates, marks
#: and zero-width characters that reorder or hide text), lone surrogates, line separators.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
#: The most characters printed of a line, and of a table's cell (a name, a shape, a dtype).
LINE_CHARS = 2000
CELL_CHARS = 120


def _escape(match: re.Match[str]) -> str:
    """The matched character as it is, or escaped if its category is hidden."""
    char = match.group()
    if char == "\t" or unicodedata.category(char) not in _HIDDEN:
        return char
    return char.encode("unicode_escape").decode("ascii")  # \x1b, \n, \u202e, \udc80


def _printable(text: str) -> str:
    """`text` with every character a terminal would act on shown escaped, as Python writes
    it (`\\x1b`, `\\n`, `\\u202e`); tabs and printable text of any script are kept."""
    return _NOT_ASCII_TEXT.sub(_escape, text)


def print_safe(*lines: str, file: TextIO | None = None) -> None:
    """Write `lines` to stdout (or `file`), each on a line of its own and
    `_printable`: a newline inside one (of a site name, a metadata string) shows as
    `\\n` and cannot forge a line, and a line longer than `LINE_CHARS` is clipped.  Every
    command prints through it, errors too: a site name comes from any dict key of the
    traced code, a run file from anyone."""
    text = "".join(clipped(_printable(line), LINE_CHARS) + "\n" for line in lines)
    (sys.stdout if file is None else file).write(text)


def table_lines(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> list[str]:
    """The lines of an aligned table; cells are made printable and clipped to `CELL_CHARS`
    first, so escaped names (`\\x1b`) keep the columns aligned."""
    from vartrace.analysis.comparison.report import table

    cells = [[clipped(_printable(cell), CELL_CHARS) for cell in row] for row in rows]
    return table(header, cells, right)


def progress(items: Sequence[Any], what: str) -> Any:
    """`items` with a progress bar on a terminal's stderr, shown after one second."""
    from vartrace._support.progress import progress_bar

    return progress_bar(items, show=sys.stderr.isatty(), desc=what)


def message_of(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
