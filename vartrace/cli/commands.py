"""`vartrace sites`, `compare`, `plot` and `tensorboard`: the commands that hand over to the
analysis layer (or, for `sites`, to the tracer's pattern resolution).

Example:
    ```python
    $ vartrace compare reference.h5 candidate.h5 --atol 1e-6
    ```
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vartrace.cli.output import UserError, message_of, print_safe
from vartrace.cli.runs import is_run_path, matches_pattern, matching, open_path, site_of


def _load_factory(spec: str) -> Any:
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise UserError(f"expected MODULE:FACTORY (e.g. mypkg.models:build), got {spec!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise UserError(f"no such file: {module_name}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise UserError(f"cannot import {module_name}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        module_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise UserError(f"cannot import module {module_name!r}: {exc}") from exc
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UserError(f"module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UserError(f"{spec} is not callable")
    return target


def cmd_sites(args: argparse.Namespace) -> int:
    factory = _load_factory(args.factory)
    try:
        model = factory()
    except Exception as exc:
        raise UserError(f"{args.factory}() failed: {message_of(exc)}") from exc
    from torch import nn

    from vartrace.tracing.sites import list_sites

    if not isinstance(model, nn.Module):
        raise UserError(f"{args.factory}() returned {type(model).__name__}, not a torch.nn.Module")
    sites = list_sites(model, args.pattern)
    if not sites:
        raise UserError(f"no site of {type(model).__name__} matches {args.pattern!r}")
    print_safe(*sites)
    return 0


@contextlib.contextmanager
def _scheduler(args: argparse.Namespace) -> Iterator[Any]:
    """The Dask scheduler `--workers N` (a LocalCluster, closed after) or `--scheduler
    ADDRESS` asks for; `None` without either (in process)."""
    if args.workers is None:
        yield args.scheduler
        return
    from vartrace.analysis.scheduling import dask_module

    distributed = dask_module("distributed", "--workers")
    with (
        distributed.LocalCluster(
            n_workers=args.workers, threads_per_worker=1, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        yield client


def cmd_compare(args: argparse.Namespace) -> int:
    from vartrace.analysis.comparison import compare

    with contextlib.ExitStack() as stack:
        run_a = stack.enter_context(open_path(args.a, args.allow_pickle))
        run_b = stack.enter_context(open_path(args.b, args.allow_pickle))
        scheduler = stack.enter_context(_scheduler(args))
        report = compare(
            run_a,
            run_b,
            atol=args.atol,
            rtol=args.rtol,
            names=args.names,
            progress=sys.stderr.isatty(),
            labels=(args.a, args.b),
            scheduler=scheduler,
        )
    print_safe(*report.lines())
    if args.csv is not None:
        report.to_csv(args.csv)
        print_safe(f"wrote {args.csv} ({len(report)} rows)")
    return 0 if report.ok else 1


def cmd_plot(args: argparse.Namespace) -> int:
    from vartrace.analysis.plot import plot_similarity, plot_stat

    first, rest = args.inputs[0], args.inputs[1:]
    if not rest:
        raise UserError("plot needs SITE names after RUN, or a second RUN for a similarity map")
    run = open_path(first, args.allow_pickle)
    try:
        similarity = (  # a site glob matching a file of the folder ('forward.*') names sites
            args.stat is None
            and len(rest) == 1
            and not any(matches_pattern(name, rest[0]) for name in run.names)
            and is_run_path(rest[0])
        )
        if similarity:
            other = open_path(rest[0], args.allow_pickle)
            try:
                from vartrace.analysis.comparison import compare

                report = compare(
                    run,
                    other,
                    atol=args.atol,
                    rtol=args.rtol,
                    progress=sys.stderr.isatty(),
                    labels=(first, rest[0]),
                )
            finally:
                other.close()
            plot_similarity(None, None, args.output, comparison=report)
            what = f"similarity of {len(report.sites)} sites"
        else:
            for name in rest:
                if name not in run.names and not any(matches_pattern(n, name) for n in run.names):
                    site_of(run, first, name)
            figure = plot_stat(
                run,
                rest,
                args.stat,
                args.output,
                progress=sys.stderr.isatty(),
                title=args.title,
                ylabel=args.ylabel,
                logy=args.logy,
            )
            lines = len(figure.axes[0].get_lines())
            stats = args.stat or ",".join(ax.get_ylabel() for ax in figure.axes if ax.get_lines())
            what = f"{stats} over iterations, {lines} line(s) per statistic"
    finally:
        run.close()
    print_safe(f"wrote {args.output} ({what})")
    return 0


def cmd_tensorboard(args: argparse.Namespace) -> int:
    from vartrace.analysis.tensorboard import export_run

    stats = [s for s in args.stat.split(",") if s] if args.stat else None
    with open_path(args.run, args.allow_pickle) as run:
        names = matching(run, args.run, args.sites) if args.sites else list(run.names)
        options: dict[str, Any] = {"histograms": not args.no_histograms}
        if stats is not None:
            options["stats"] = stats
        written = export_run(run, args.logdir, names=names, progress=sys.stderr.isatty(), **options)
    print_safe(
        f"wrote {written} record(s) of {len(names)} site(s) to {args.logdir}",
        f"view them with: tensorboard --logdir {args.logdir}",
    )
    return 0
