"""Text for people: byte sizes, numbers, text clipped to a length, and the KeyError for a
site name that names what is there.

Every message of vartrace that states a size says it through `size_text`, so a size reads
the same in a warning, an error and `vartrace ls`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["clipped", "close_matches", "missing_site", "numbers_text", "size_text"]


def missing_site(name: str, names: Iterable[str], where: str) -> KeyError:
    """The KeyError for site `name`, absent from `where` (which holds `names`).

    It names up to five close matches (a plain `@every` name gets its per-line
    keys).  Example:

    ```python
    raise missing_site("forward.h@every", ["forward.h@every:L12"], "run.h5")
    # KeyError: "no site 'forward.h@every' in run.h5; close matches: forward.h@every:L12"
    ```
    """
    close = close_matches(name, names, n=5, cutoff=0.5)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    return KeyError(f"no site {name!r} in {where}{hint}")


def size_text(nbytes: float) -> str:
    """`nbytes` for a reader, in binary units: `"4 bytes"`, `"1.5 KiB"`, `"40 MiB"`, `"512 GiB"`.

    Example:
        ```python
        size_text(3 << 29)   # "1.5 GiB"
        ```
    """
    if abs(nbytes) < 1024:
        return f"{nbytes:.0f} bytes"
    amount = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        amount /= 1024
        if abs(amount) < 1024 or unit == "PiB":
            break
    return f"{amount:.1f}".removesuffix(".0") + f" {unit}"


def close_matches(
    word: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6
) -> list[str]:
    """Up to `n` of `candidates` close to `word`, the closest first (for "did you mean").

    Example:
        ```python
        close_matches("layers.0.atn", ["layers.0.attn", "layers.0.mlp"])   # ["layers.0.attn"]
        ```
    """
    return difflib.get_close_matches(word, list(candidates), n=n, cutoff=cutoff)


def numbers_text(numbers: Iterable[int]) -> str:
    """Sorted integers for a reader, three or more consecutive ones as a range.

    Example:
        ```python
        numbers_text([7, 1, 2, 3, 4, 9, 10])   # "1-4, 7, 9, 10"
        ```
    """
    ordered = sorted(set(numbers))
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{ordered[start]}-{ordered[end]}")
        else:
            parts.extend(str(n) for n in ordered[start : end + 1])
        start = end + 1
    return ", ".join(parts)


def clipped(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and how many there were when it is longer
    (a string a crafted file holds can be a megabyte long).

    Example:
        ```python
        clipped("x" * 5000, 20)   # "xxxxxxxxxxxxxxxxxxxx... (5000 characters)"
        ```
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
