"""A file written by an older release reads the same today.

`data/written_by_4abe5f2.h5.gz` was written by vartrace at 4abe5f2, the last commit before the
package was laid out in layers, by `data/written_by_4abe5f2.py` (whole records of float32,
bfloat16 and bool values, a dict entry, a scalar, a parameter's @grad, an all-zero input);
`data/written_by_4abe5f2.json` is every record as that release read it back.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import torch

import vartrace

DATA = Path(__file__).parent / "data"


def _records(path: Path) -> dict[str, list[list[object]]]:
    """Each site's records: [iteration, dtype, shape, values as float64] or [iteration,
    type, repr] for a value that is not a tensor."""
    found: dict[str, list[list[object]]] = {}
    with vartrace.open(path) as run:
        for name in sorted(run):
            site = run[name]
            rows: list[list[object]] = []
            for iteration in site.iterations:
                value = site.get(iteration=iteration)
                if isinstance(value, torch.Tensor):
                    flat = value.double().flatten().tolist()
                    rows.append([int(iteration), str(value.dtype), list(value.shape), flat])
                else:
                    rows.append([int(iteration), type(value).__name__, repr(value)])
            found[name] = rows
    return found


def test_a_file_written_before_the_layers_reads_as_its_release_read_it(tmp_path: Path) -> None:
    path = tmp_path / "old.h5"
    with gzip.open(DATA / "written_by_4abe5f2.h5.gz") as packed, path.open("wb") as out:
        shutil.copyfileobj(packed, out)
    expected = json.loads((DATA / "written_by_4abe5f2.json").read_text())
    assert sorted(expected) == [
        "forward.flags",
        "forward.h",
        "forward.half",
        "forward.info.mean",
        "forward.info.n",
        "lin.weight@grad",
    ]
    assert _records(path) == expected
