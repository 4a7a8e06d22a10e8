"""The `vartrace` command: look at runs without writing a script.

Subcommands:

```python
vartrace ls RUN                         sites, records, shapes, dtypes, iterations, bytes
vartrace show RUN SITE... [--iteration I] [--rank R]
vartrace meta RUN [KEY]                 command, packages, git state, ...
vartrace sites MODULE:FACTORY [PATTERN] capturable sites of a model
vartrace compare A B [--atol --rtol --csv OUT --names PATTERN ...]
                 [--workers N | --scheduler tcp://host:8786]   on Dask
vartrace plot RUN SITE... [--stat mean,std] -o out.png [--title --ylabel --logy]
vartrace plot A B -o out.png            similarity heat map
```

`RUN` is an HDF5 file or a glob of per-rank shards (quote it:
`'run.rank*.h5'`); `SITE` may be a glob (`'layers.*.forward'`).  Sites
are listed in execution order.  `show --iteration K` prints the value each
site held at iteration K: its last record at or before K (change detection
stores a value only when it changes).  `compare` exits 1 when anything differs beyond
tolerance, so it can guard numerics in CI.  Errors print one line to
stderr and exit 2.  Everything is printed through `_print`, which shows control
and format characters of site names, metadata and paths escaped (``, `‮`).

Example:
    ```python
    $ vartrace compare reference.h5 candidate.h5 --atol 1e-6 --csv diff.csv
    ```
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn, TextIO

from vartrace.cli.commands import cmd_compare, cmd_plot, cmd_sites, cmd_tensorboard
from vartrace.cli.inspect import cmd_ls, cmd_meta, cmd_show
from vartrace.cli.output import UserError, message_of, print_safe

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message: str) -> NoReturn:
        print_safe(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


# --------------------------------------------------------------------------- parser


def _positive(text: str) -> int:
    """An argument that must be a whole number above 0."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a number of workers above 0, got {text!r}")
    return number


_RUN_HELP = "an HDF5 run file, or a quoted glob of per-rank shards ('run.rank*.h5')"
_PICKLE_HELP = (
    "unpickle records stored as pickled objects (runs code stored in the file: "
    "only for files you trust)"
)


def _parser() -> argparse.ArgumentParser:
    from vartrace._version import __version__

    parser = _Parser(
        prog="vartrace",
        description="Look at vartrace runs: list, show, compare and plot recorded values.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("ls", help="list the sites of a run, in execution order")
    p.add_argument(
        "run",
        metavar="RUN",
        nargs="+",
        help=_RUN_HELP + "; several: the shards of one run in several directories",
    )
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "show",
        help="print the recorded values of sites",
        description="Without --iteration: a table of every record.  With --iteration K: the "
        "value each site held at K, i.e. its last record at or before K.",
    )
    p.add_argument("run", metavar="RUN", help=_RUN_HELP)
    p.add_argument(
        "sites", metavar="SITE", nargs="+", help="site names or quoted globs ('layers.*')"
    )
    p.add_argument(
        "--iteration",
        "-i",
        type=int,
        help="print the value held at this iteration (its last record at or before it)",
    )
    p.add_argument("--rank", "-r", type=int, help="only records of this rank (default: all)")
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE_HELP)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("meta", help="print a run's metadata (command, packages, git, ...)")
    p.add_argument("run", metavar="RUN", help=_RUN_HELP)
    p.add_argument(
        "key",
        metavar="KEY",
        nargs="?",
        help="print only this entry, dotted (git.commit), in full: long ones (git.diff, "
        "packages) are summarized otherwise",
    )
    p.set_defaults(func=cmd_meta)

    p = sub.add_parser("sites", help="list the capturable sites of a model built by a factory")
    p.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="a callable returning the model: mypkg.models:build or path/to/file.py:build",
    )
    p.add_argument(
        "pattern", metavar="PATTERN", nargs="?", default="**", help="a path pattern (default **)"
    )
    p.set_defaults(func=cmd_sites)

    p = sub.add_parser("compare", help="compare two runs; exit 1 when they differ")
    p.add_argument("a", metavar="A", help="the first run: " + _RUN_HELP)
    p.add_argument("b", metavar="B", help="the second run, the reference of --rtol")
    p.add_argument("--atol", type=float, default=1e-8, help="absolute tolerance (1e-8)")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (1e-5)")
    p.add_argument("--csv", metavar="OUT", help="write one row per record pair to OUT")
    p.add_argument("--names", nargs="+", metavar="PATTERN", help="compare only these sites")
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE_HELP)
    engine = p.add_mutually_exclusive_group()
    engine.add_argument(
        "--workers",
        type=_positive,
        metavar="N",
        help="compare on a Dask LocalCluster of N worker processes, a task per pair of "
        "shards (needs pip install 'torch-vartrace[dask]')",
    )
    engine.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="compare on the Dask cluster at ADDRESS (tcp://host:8786)",
    )
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "plot",
        help="plot statistics over iterations, or a similarity heat map of two runs",
        usage="%(prog)s RUN SITE... [--stat STAT] -o OUTPUT [--title T] [--ylabel Y] [--logy] "
        "[--allow-pickle]\n"
        "       %(prog)s A B -o OUTPUT [--atol ATOL] [--rtol RTOL] [--allow-pickle]",
        description="RUN SITE...: statistics of sites over iterations, one line per rank, "
        "sites ordered and coloured by name (layers.2 before layers.10).  "
        "A B: a heat map of the similarity of two runs, sites x iterations.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="a run and site names or quoted globs; or two runs for a similarity map",
    )
    p.add_argument(
        "--stat",
        help="statistics, comma separated (default mean,std, or the value of sites of scalars; "
        "also var, min, max, absmax, norm, nan, posinf, neginf, zeros, count; q0.5... of "
        "statistics records), over finite values",
    )
    p.add_argument("-o", "--output", required=True, help="image file to write (.png, .pdf, .svg)")
    p.add_argument(
        "--title", help="the figure's title (default: the statistics and the run's file name)"
    )
    p.add_argument("--ylabel", help="the y axis label (default: the statistic)")
    p.add_argument(
        "--logy", action="store_true", help="a logarithmic y axis (symlog where values reach 0)"
    )
    p.add_argument("--atol", type=float, default=1e-8, help="similarity map: absolute tolerance")
    p.add_argument("--rtol", type=float, default=1e-5, help="similarity map: relative tolerance")
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE_HELP)
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser(
        "tensorboard",
        help="write a run's statistics and histograms as TensorBoard event files",
        description="Each numeric record becomes scalars <site>/<statistic> (over finite "
        "values; nan, posinf, neginf count the others) and a histogram <site>, at its "
        "iteration.  Needs pip install 'torch-vartrace[tensorboard]'.",
    )
    p.add_argument("run", metavar="RUN", help=_RUN_HELP)
    p.add_argument("--logdir", required=True, help="folder of the event files to write")
    p.add_argument(
        "--sites", nargs="+", metavar="SITE", help="only these sites (names or quoted globs)"
    )
    p.add_argument(
        "--stat",
        help="statistics written as scalars, comma separated "
        "(default mean,std,min,max,absmax,nan,posinf,neginf)",
    )
    p.add_argument("--no-histograms", action="store_true", help="write scalars only")
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE_HELP)
    p.set_defaults(func=cmd_tensorboard)
    return parser


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Print a warning of a library (matplotlib's missing glyph of a site name) in one line
    through `print_safe`, as `warnings.showwarning` during a command."""
    print_safe(f"{filename}:{lineno}: {category.__name__}: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `vartrace` command line; return the exit status.

    Example:
        ```python
        >>> main(["ls", "run.h5"])
        0
        ```
    """
    args = _parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return int(args.func(args))
    except UserError as exc:
        print_safe(f"vartrace {args.command}: error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print_safe("vartrace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 0
    except Exception as exc:
        print_safe(f"vartrace {args.command}: error: {message_of(exc)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
