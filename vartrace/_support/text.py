"""The KeyError for a site name a mapping of sites lacks, naming what is there.

A module of its own, importing nothing of vartrace: the tracer's in-memory results and
the run-file reader both raise it, without one importing the other.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["missing_site"]


def missing_site(name: str, names: Iterable[str], where: str) -> KeyError:
    """The KeyError for site `name`, absent from `where` (which holds `names`).

    It names up to five close matches (a plain `@every` name gets its per-line
    keys).  Example:

    ```python
    raise missing_site("forward.h@every", ["forward.h@every:L12"], "run.h5")
    # KeyError: "no site 'forward.h@every' in run.h5; close matches: forward.h@every:L12"
    ```
    """
    close = difflib.get_close_matches(name, list(names), n=5, cutoff=0.5)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    return KeyError(f"no site {name!r} in {where}{hint}")
