"""Plots of runs: a statistic over iterations, and a two-run similarity heat map.

matplotlib is an optional extra (`pip install 'torch-vartrace[plot]'`); it is
imported only when a plot is made.  The functions build a
`matplotlib.figure.Figure` without pyplot (no global state, no
display needed), save it when `path` is given, and return it.

Example:
    ```python
    from vartrace.analysis.plot import plot_similarity, plot_stat

    plot_stat("run.h5", ["layers.0.out", "layers.1.out"], ("mean", "std"), "stats.png")
    plot_similarity("fp32.h5", "bf16.h5", "similarity.png")
    ```
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from vartrace._support.progress import progress_bar
from vartrace.analysis.sources import Source, open_source, record_stats, stat_function
from vartrace.analysis.sources.views import STATISTICS
from vartrace.statistics.named import COUNTS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_similarity", "plot_stat"]


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as exc:
        hint = "pip install 'torch-vartrace[plot]'"
        raise ImportError(f"vartrace plots need matplotlib: {hint}") from exc
    del matplotlib
    return Figure


def _natural_key(name: str) -> list[str | int]:
    """Sort key of a site name with its numbers as numbers: `layers.2` before `layers.10`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _expand(source: Source, sites: str | Sequence[str]) -> list[str]:
    """Site names and glob patterns -> site names of `source`: the patterns in the order
    given, the sites a glob matches in name order (numbers as numbers), so a site keeps its
    colour and legend place from one figure to the next, the gradients of the layers
    (`@grad`, run backwards) as their forward values."""
    wanted = [sites] if isinstance(sites, str) else list(sites)
    if not wanted:
        raise ValueError("name at least one site to plot")
    names: list[str] = []
    for pattern in wanted:
        matched = source.pick(pattern)
        if len(matched) > 1:  # a glob's sites in name order, numbers as numbers
            matched.sort(key=_natural_key)
        if not matched:
            raise KeyError(f"{source.label} has no site {pattern!r}")
        names.extend(n for n in matched if n not in names)
    return names


def _x_positions(iterations: np.ndarray, ranks: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Iteration numbers, spread within the iteration when a site has several records there."""
    x = iterations.astype(np.float64)
    key = np.lexsort((order, ranks, iterations))
    it, rk = iterations[key], ranks[key]
    start = np.ones(len(key), dtype=bool)
    start[1:] = (it[1:] != it[:-1]) | (rk[1:] != rk[:-1])
    group = np.cumsum(start) - 1
    first = np.flatnonzero(start)
    occurrence = np.arange(len(key)) - first[group]
    sizes = np.diff(np.append(first, len(key)))[group]
    x[key] += occurrence / sizes
    return x


def _colors(count: int) -> list[Any]:
    """Distinct colours for few lines (tab10); beyond, a gradient in name order (depth)."""
    from matplotlib import colormaps

    if count <= 10:
        return [colormaps["tab10"](i) for i in range(count)]
    return [colormaps["turbo"](x) for x in np.linspace(0.0, 1.0, count)]


#: Beyond this many sites a plot names them on a colour bar (in name order), not a legend.
_LEGEND_SITES = 16


def _site_colour_bar(fig: Any, axes: Any, names: list[str]) -> None:
    """A colour bar naming sites in name order (first, some between, last)."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    mappable = ScalarMappable(Normalize(-0.5, len(names) - 0.5), colormaps["turbo"])
    bar = fig.colorbar(mappable, ax=list(axes), location="right", fraction=0.04, pad=0.01)
    spread = np.linspace(0, len(names) - 1, min(len(names), 12)).round().astype(int)
    ticks = sorted(set(spread.tolist()))
    bar.set_ticks(ticks, labels=[names[t] for t in ticks], fontsize=7)
    bar.set_label(f"{len(names)} sites, in name order")


def _short(label: str) -> str:
    return os.path.basename(label) or label


#: The largest finite magnitude (``finfo.max``) of the float dtypes a record may have.
_DTYPE_LIMITS = {
    "float16": float(np.finfo(np.float16).max),
    "bfloat16": (2.0 - 2.0**-7) * 2.0**127,
    "float32": float(np.finfo(np.float32).max),
    "float64": float(np.finfo(np.float64).max),
    "complex64": float(np.finfo(np.float32).max),
    "complex128": float(np.finfo(np.float64).max),
}


def _at_dtype_limits(dtypes: Sequence[str], low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Per record: it holds a value at or beyond its dtype's `finfo.min`/`finfo.max`
    (a mask value, `torch.finfo(dtype).min`), from its finite `low`/`high`.

    A statistics record (its tensor's dtype not stored) counts when its min or max is
    exactly the limit of one of the float dtypes.
    """
    low, high = np.abs(low), np.abs(high)
    limit = np.array([_DTYPE_LIMITS.get(dtype, math.inf) for dtype in dtypes])
    flags = np.fmax(low, high) >= limit  # NaN (no finite value) compares False
    statistics = np.array([dtype == STATISTICS for dtype in dtypes], dtype=bool)
    known = np.array(sorted(set(_DTYPE_LIMITS.values())))
    return flags | (statistics & (np.isin(low, known) | np.isin(high, known)))


def plot_stat(
    run: Any,
    sites: str | Sequence[str],
    stats: str | Sequence[str] | None = None,
    path: str | os.PathLike[str] | None = None,
    *,
    progress: bool = False,
    title: str | None = None,
    ylabel: str | None = None,
    logy: bool = False,
) -> Figure:
    """A statistic of each record over iterations: one subplot per statistic, a line per rank.

    `run` is a path (or shard glob), an open run, a ModelTracer or its
    results; `sites` names sites or glob patterns; `stats` are names from
    `vartrace.analysis.sources.STATS` (`"mean,std"` works too; default `mean,std`, or,
    when every record is a scalar, such as a loss or an entropy reduced in the model,
    the value itself, labelled by the sites' name: `entropy` for `layers.*.entropy`).
    Saves to `path` when given and returns the figure; `progress` shows tqdm bars
    on stderr for work that takes more than a second.  `title` replaces the title (which
    otherwise names the statistics and the file), `ylabel` the y label (of several
    statistics: `ylabel (stat)`), and `logy` scales y logarithmically (symlog where a curve
    reaches 0 or below, so no point disappears).  Sites are ordered and coloured by
    name, numbers as numbers (`layers.2` before `layers.10`): a layer keeps its colour
    and legend place from one figure to the next, its gradients (`@grad`, recorded
    backwards) as its forward values (several patterns: in the order given).  Beyond 10
    sites, the colours run from blue to red; up to 16 sites get a legend, more a colour
    bar naming them.  Statistics sites
    ([`vartrace.stats`][vartrace.stats]) plot their stored fields (`absmax`, `nan`,
    `q0.5`...); every statistic is over the finite values, NaN, +inf and -inf
    being counted by `nan`, `posinf`, `neginf`.  A record holding values at
    its dtype's `finfo.min`/`finfo.max` (an attention mask: its mean is near
    -3.4e38) is left out of the value statistics' curves and scale, marked at the
    axis edge (`▼` below, `▲` above) with a note saying how many; the counts
    plot it as it is.

    Example:
        ```python
        fig = plot_stat("run.h5", "layers.*.out", "mean,std", "out.png")
        len(fig.axes)   # 2
        ```
    """
    Figure = _matplotlib()
    stat_names = _stat_names(("mean", "std") if stats is None else stats)
    with open_source(run) as source:
        names = _expand(source, sites)
        views = [source.site(name) for name in names]
        for name, view in zip(names, views, strict=True):
            if all(shape is None for shape in view.shapes) and STATISTICS not in view.dtypes:
                raise ValueError(f"site {name!r} holds no numeric values to plot")
        labels = {stat: stat for stat in stat_names}
        if stats is None and all(_scalars_only(view) for view in views):
            stat_names, labels = ["mean"], {"mean": _proper_name(names)}
        curves = []
        pairs = list(zip(names, views, strict=True))
        for name, view in progress_bar(pairs, show=progress, desc="plot", unit="site"):
            wanted = list(dict.fromkeys([*stat_names, "min", "max"]))
            values = record_stats(view, wanted, progress=progress)
            extreme = _at_dtype_limits(view.dtypes, values["min"], values["max"])
            x = _x_positions(view.iterations, view.ranks, view.order)
            curves.append((name, view.ranks, x, values, extreme))
        label = source.label
    all_ranks = sorted({int(r) for _, ranks, *_ in curves for r in np.unique(ranks)})
    multi_rank = len(all_ranks) > 1
    many = len(curves) > _LEGEND_SITES
    colors = _colors(len(curves))
    styles = ("-", "--", ":", "-.")
    fig = Figure(figsize=(10.0, 1.2 + 2.6 * len(stat_names)), layout="constrained")
    axes = fig.subplots(len(stat_names), 1, sharex=True, squeeze=False)[:, 0]
    for ax, stat in zip(axes, stat_names, strict=True):
        # a count is not scaled by the values; a value statistic of a record holding a mask
        # value (-3.4e38) is left out of the scale, unless nothing else is there
        hide = stat not in COUNTS and _kept_points(curves, stat)
        off_scale: list[tuple[Any, np.ndarray, np.ndarray]] = []
        for color, (name, ranks, x, values, extreme) in zip(colors, curves, strict=True):
            y = values[stat]
            if hide and extreme.any():
                off = extreme & ~np.isnan(y)
                off_scale.append((color, x[off], y[off]))
                y = np.where(extreme, math.nan, y)
            for rank in np.unique(ranks):
                mask = ranks == rank
                order = np.argsort(x[mask], kind="stable")
                ax.plot(
                    x[mask][order],
                    y[mask][order],
                    color=color,
                    linestyle=styles[all_ranks.index(int(rank)) % len(styles)],
                    marker="o" if mask.sum() <= 50 else None,
                    markersize=3,
                    linewidth=1.2,
                    label=f"{name} [rank {rank}]" if multi_rank else name,
                )
        if ylabel is None:
            ax.set_ylabel(labels[stat])
        else:
            ax.set_ylabel(ylabel if len(stat_names) == 1 else f"{ylabel} ({labels[stat]})")
        if logy:
            ax.set_yscale("log" if _all_positive(ax) else "symlog")
        ax.grid(True, alpha=0.3)
        if off_scale:
            _mark_off_scale(ax, off_scale)
    axes[-1].set_xlabel("iteration")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    shown = ", ".join(labels[stat] for stat in stat_names)
    axes[0].set_title(f"{shown} over iterations — {_short(label)}" if title is None else title)
    if many:  # a legend of that many entries would be cut off
        _site_colour_bar(fig, axes, [name for name, *_ in curves])
    else:  # beside the plots, so it never hides a curve
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    if path is not None:
        fig.savefig(os.fspath(path), dpi=120)
    return fig


def _stat_names(stats: str | Sequence[str]) -> list[str]:
    """The statistics asked for (`"mean,std"` or a list), each checked to exist."""
    names = [s.strip() for s in stats.split(",")] if isinstance(stats, str) else list(stats)
    if not names:
        raise ValueError("name at least one statistic")
    for stat in names:
        if not stat.startswith(("q", "log2|x|")):  # those are fields of statistics records
            stat_function(stat)
    return names


def _scalars_only(view: Any) -> bool:
    """Whether every record of a site is one number (a loss, a norm, an entropy)."""
    return all(shape is not None and math.prod(shape) == 1 for shape in view.shapes)


def _proper_name(names: list[str]) -> str:
    """What scalar sites hold, by their name: the last part they share (`entropy` of
    `layers.0.entropy`, `layers.1.entropy`), else the one site's name, else `value`."""
    if len(names) == 1:
        return names[0]
    leaves = {name.rsplit(".", 1)[-1] for name in names}
    return leaves.pop() if len(leaves) == 1 else "value"


def _all_positive(ax: Any) -> bool:
    """Whether every finite value drawn on `ax` is above 0 (a log scale shows them all)."""
    for line in ax.get_lines():
        y = np.asarray(line.get_ydata(), dtype=np.float64)
        if (y[np.isfinite(y)] <= 0).any():
            return False
    return True


def _kept_points(curves: list[tuple[Any, ...]], stat: str) -> bool:
    """Whether some record without values at its dtype's limits has a value of `stat`."""
    return any(bool(np.isfinite(values[stat][~extreme]).any()) for *_, values, extreme in curves)


def _mark_off_scale(ax: Any, points: list[tuple[Any, np.ndarray, np.ndarray]]) -> None:
    """Mark the records left out of `ax`'s scale at its bottom (negative) or top edge,
    in their site's colour, and say why in a note on the axis.

    `points` holds, per site, its colour and the iterations and values of its records
    holding values at their dtype's `finfo.min`/`finfo.max`: a mask value makes a
    record's min -3.4e38 and its mean near it, which would scale the axis to 1e38 and
    flatten every other curve.
    """
    limits = ax.get_ylim()
    edge = ax.get_xaxis_transform()  # x in iterations, y from 0 (bottom) to 1 (top)
    for color, x, y in points:
        for side, marker, at in ((y < 0, "v", 0.0), (y >= 0, "^", 1.0)):
            if side.any():
                ax.scatter(
                    x[side],
                    np.full(int(side.sum()), at),
                    transform=edge,
                    marker=marker,
                    color=color,
                    s=18,
                    clip_on=False,
                    zorder=3,
                )
    ax.set_ylim(limits)  # the markers do not rescale the axis
    count = sum(len(x) for _, x, _ in points)
    ax.text(
        0.01,
        0.04,
        f"\u25bc\u25b2 {count} record(s) holding values at their dtype's finfo.min/max "
        "(a mask): off this scale",
        transform=ax.transAxes,
        fontsize=7,
        color="dimgrey",
    )


def _similarity_matrix(frame_rows: list[dict[str, Any]], sites: list[str]) -> tuple[Any, ...]:
    """(cosine matrix, beyond-tolerance mask, iterations) with the worst record per cell."""
    iterations = sorted({int(r["iteration"]) for r in frame_rows if r["order_a"] >= 0})
    col = {it: j for j, it in enumerate(iterations)}
    row = {site: i for i, site in enumerate(sites)}
    cos = np.full((len(sites), len(iterations)), np.nan)
    bad = np.zeros(cos.shape, dtype=bool)
    unscored = np.zeros(cos.shape, dtype=bool)
    for r in frame_rows:
        if r["site"] not in row or int(r["iteration"]) not in col:
            continue
        i, j = row[r["site"]], col[int(r["iteration"])]
        value = r["cosine"]
        if value is None or math.isnan(value):
            # no cosine (str, None, statistics records...): equal counts as 1; a differing
            # pair is painted the lowest colour below, never the "no record" grey
            value = 1.0 if r["status"] == "ok" else math.nan
            unscored[i, j] |= r["status"] != "not compared" and math.isnan(value)
        if not math.isnan(value):
            cos[i, j] = value if math.isnan(cos[i, j]) else min(cos[i, j], value)
        if r["status"] not in ("ok", "not compared"):
            bad[i, j] = True
    return cos, bad, unscored, iterations


def plot_similarity(
    a: Any,
    b: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    atol: float = 1e-8,
    rtol: float = 1e-5,
    names: str | Sequence[str] | None = None,
    comparison: Any = None,
) -> Figure:
    """Heat map of the cosine similarity of two runs: sites (rows) x iterations (columns).

    Each cell is the smallest cosine similarity of that site's records in
    that iteration (over ranks and repeated calls); cells beyond tolerance
    (`atol`/`rtol`, or a shape mismatch, or a record missing on one side)
    carry a red `x`; grey cells have no record.  Records without a cosine
    (non-numeric, statistics) count as 1 when equal and take the lowest colour
    when they differ.  Sites are in execution
    order.  Pass `comparison` (a [`Comparison`][vartrace.Comparison])
    to reuse one already computed.

    Example:
        ```python
        fig = plot_similarity("fp32.h5", "bf16.h5", "similarity.png", atol=1e-3)
        ```
    """
    Figure = _matplotlib()
    from matplotlib.colors import Normalize

    if comparison is None:
        from vartrace.analysis.comparison import compare

        comparison = compare(a, b, atol=atol, rtol=rtol, names=names)
    sites = [s.site for s in comparison.sites]
    if not sites:
        raise ValueError("the two runs have no site in common: nothing to plot")
    cos, bad, unscored, iterations = _similarity_matrix(list(comparison.rows()), sites)
    n_sites, n_iters = cos.shape
    font = 9 if n_sites <= 30 else 7
    longest = max(len(s) for s in sites)
    width = min(20.0, max(7.0, 2.5 + 0.07 * longest * font / 7 + 0.22 * n_iters))
    height = min(60.0, max(3.5, 1.6 + 0.19 * n_sites * font / 7))
    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.subplots()
    finite = cos[np.isfinite(cos)]
    low = float(finite.min()) if finite.size else 0.0
    low = min(low, 1.0 - 1e-6)
    cos = np.where(unscored & np.isnan(cos), low, cos)
    cmap = _colormap()
    image = ax.imshow(
        np.ma.masked_invalid(cos),
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        norm=Normalize(vmin=low, vmax=1.0),
    )
    if bad.any():
        rows, cols = np.nonzero(bad)
        marker = max(8.0, min(40.0, 2400.0 / max(n_sites, n_iters)))
        ax.scatter(cols, rows, marker="x", color="red", s=marker, linewidths=1.0)
    ax.set_yticks(range(n_sites), sites, fontsize=font)
    step = max(1, math.ceil(n_iters / 25))
    ticks = list(range(0, n_iters, step))
    ax.set_xticks(ticks, [str(iterations[t]) for t in ticks], fontsize=font)
    ax.set_xlabel("iteration    (red x: beyond tolerance; grey: no record)")
    ax.set_ylabel("site (execution order)")
    labels = comparison.labels
    ax.set_title(f"cosine similarity: {_short(labels[0])} vs {_short(labels[1])}", fontsize=11)
    bar = fig.colorbar(image, ax=ax, shrink=min(1.0, 8.0 / height + 0.3), pad=0.01)
    bar.set_label("cosine similarity (min over records)")
    bar.formatter.set_useOffset(False)
    if path is not None:
        fig.savefig(os.fspath(path), dpi=110)
    return fig


def _colormap() -> Any:
    from matplotlib import colormaps

    return colormaps["viridis"].with_extremes(bad="lightgrey")
