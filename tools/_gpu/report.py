"""``gpu_check.py``'s verdicts and table: the bars of the issues, pass or fail, and one row per
contender, printed last."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _harness import table

from _gpu.contenders import Contender

BUDGET_S = 360.0  # the whole run on an H100, --compile aside

# The step-time bars of the issues (mean and median ratio to the untraced step).
RATIO_BARS = {
    "vartrace async": 1.05,
    "vartrace async + HDF5": 1.10,
    "vartrace async @grad": 1.05,
    "vartrace device=cuda": 1.03,
    "vartrace async tiny": 1.02,
    "vartrace async stats": 1.03,
}


def default_host_bytes() -> int:
    """``ModelTracer``'s default ``max_host_bytes``: a tenth of the memory, at most 8 GiB."""
    return min(8 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 10)


def bars(result: dict[str, Any], items: list[Contender]) -> list[tuple[str, str, str]]:
    """The issue's bars: (bar, what was measured, PASS / FAIL / SKIP)."""
    skips = {c.name: c.skip for c in items if c.skip}
    staged = [c.name for c in items if c.staged and not c.skip]
    timing = result["timing"]["contenders"]
    out = []

    def ratio_bar(name: str, limit: float) -> None:
        bar = f"{name}: step <= {limit:.2f}x untraced (mean and median)"
        row = timing.get(name)
        if row is None:
            out.append((bar, f"skipped: {skips.get(name, '?')}", "SKIP"))
        elif "ratio" not in row:
            out.append((bar, row.get("error", "no steps"), "FAIL"))
        else:
            worst = max(row["ratio"], row["ratio_median"])
            measured = f"{row['ratio']:.3f}x / {row['ratio_median']:.3f}x"
            if result["env"]["device_type"] != "cuda":
                out.append((bar, f"{measured} (CPU smoke: not judged)", "SKIP"))
            else:
                out.append((bar, measured, "PASS" if worst <= limit else "FAIL"))

    def all_bar(bar: str, rows: dict[str, Any] | None, ok: Callable[[Any], bool]) -> None:
        if rows is None:
            out.append((bar, "CUDA only", "SKIP"))
            return
        if not staged:
            out.append((bar, f"no async contender: {skips.get('vartrace async', '?')}", "SKIP"))
            return
        failed = [n for n in staged if "error" in rows.get(n, {"error": 1}) or not ok(rows[n])]
        measured = f"failed: {', '.join(failed)}" if failed else f"{len(staged)} contender(s)"
        out.append((bar, measured, "FAIL" if failed else "PASS"))

    for name, limit in RATIO_BARS.items():
        ratio_bar(name, limit)
    row = timing.get("vartrace async", {})
    bound = default_host_bytes()
    if "rss_growth_mib" in row:
        grown = row["rss_growth_mib"] * 2**20
        out.append(
            (
                f"async: resident memory growth <= max_host_bytes ({bound / 2**30:.1f} GiB)",
                f"{row['rss_growth_mib']:.0f} MiB",
                "PASS" if grown <= bound else "FAIL",
            )
        )
    all_bar(
        "async: 0 syncs in the step (training + autograd threads)",
        result.get("syncs"),
        lambda row: row["in_step_per_step"] == 0,
    )
    all_bar(
        "async: two steps pass sync-debug mode 'error'",
        result.get("sync_debug"),
        lambda row: not row["raised"],
    )
    exact = {c.name: result["exactness"].get(c.name, {}) for c in items if c.exact and not c.skip}
    exact.pop("untraced", None)
    failed = [
        name
        for name, row in exact.items()
        if "error" in row or row.get("mismatched") or row.get("missing")
    ]
    checked = sum(row.get("compared", 0) for row in exact.values())
    out.append(
        (
            "0 mismatches against blocking copies",
            f"failed: {', '.join(failed)}" if failed else f"{checked} records compared",
            "FAIL" if failed or not checked else "PASS",
        )
    )
    sanitizer = result.get("csan")
    if not isinstance(sanitizer, dict) or "skipped" in (sanitizer or {}):
        why = sanitizer["skipped"] if isinstance(sanitizer, dict) else "not run"
        out.append(("CUDA sanitizer: 0 races", why, "SKIP"))
    elif "error" in sanitizer:
        out.append(("CUDA sanitizer: 0 races", sanitizer["error"], "FAIL"))
    else:
        ok = sanitizer["races"] == 0 and sanitizer["rc"] == 0
        measured = f"{sanitizer['races']} races, exit {sanitizer['rc']}"
        out.append(("CUDA sanitizer: 0 races", measured, "PASS" if ok else "FAIL"))
    return out


def _cpu_cell(row: dict[str, Any]) -> str:
    """CPU per step of the training thread / of every other thread (staging, OpenMP...)."""
    if "main_cpu_ms" not in row:
        return "-"
    return f"{row['main_cpu_ms']:.1f}/{row['other_cpu_ms']:.1f} ms"


def _cell(row: dict[str, Any], key: str, form: str, unit: str = "") -> str:
    return format(row[key], form) + unit if key in row else "-"


def _debug_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    return f"raised at {row['where']}" if row["raised"] else "ok"


def _exact_cell(row: dict[str, Any]) -> str:
    if "compared" not in row:
        return "-"
    cell = f"{row['mismatched']}/{row['compared']}"
    if row["missing"]:
        cell += f" ({row['missing']} missing)"
    return cell + (f", wpe x{row['wpe_records']}" if "wpe_records" in row else "")


def _staging_cell(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "-"
    fields = ("staged", "kept", "unchanged", "dropped", "waits")
    return "/".join(str(stats.get(k, "?")) for k in fields)


def report(result: dict[str, Any], items: list[Contender]) -> str:
    """The final table: one row per contender, skipped ones with the reason."""
    timing = result["timing"]["contenders"]
    header = ["contender", "mean", "median", "ratio", "peak +MiB", "main/other CPU", "RSS +MiB"]
    header += ["syncs/step", "sync-debug", "exact", "staging staged/kept/unch/drop/waits", "note"]
    rows = []
    for c in items:
        if c.skip:
            rows.append([c.name, *["-"] * 10, f"skipped: {c.skip}"])
            continue
        row = timing.get(c.name, {})
        syncs = result.get("syncs", {}).get(c.name, {})
        exact = result["exactness"].get(c.name, {})
        notes = [n for n in (row.get("error"), c.note) if n]
        if "h5_mib_per_step" in row:
            notes.append(f"{row['h5_mib_per_step']:.1f} MiB h5/step")
        notes += [
            f"{what}: {r['error']}"
            for what, r in (("exact", exact), ("syncs", syncs))
            if "error" in r
        ]
        rows.append(
            [
                c.name,
                _cell(row, "mean_ms", ".1f", " ms"),
                _cell(row, "median_ms", ".1f", " ms"),
                _cell(row, "ratio", ".3f", "x"),
                _cell(row, "peak_extra_mib", ".0f"),
                _cpu_cell(row),
                _cell(row, "rss_growth_mib", ".0f"),
                _cell(syncs, "in_step_per_step", ".2f"),
                _debug_cell(result.get("sync_debug", {}).get(c.name)),
                _exact_cell(exact),
                _staging_cell(row.get("staging")),
                "; ".join(notes),
            ]
        )
    env = result["env"]
    plan = env["plan"]
    title = (
        f"{env['device']}: {plan['size']['layers']}-block d{plan['size']['d']} training step, "
        f"{result['timing']['host']['rounds']} interleaved rounds of {plan['steps']} steps; "
        "mean step, its ratio to the untraced mean; syncs per step on the training and "
        "autograd threads; exact = mismatched/compared"
    )
    return "\n".join([title, *table(header, rows, (0, -1))])


def print_report(result: dict[str, Any], items: list[Contender], out: Path) -> None:
    """Where the syncs are, the bars, and the table, last."""
    print()
    for name, row in result.get("syncs", {}).items():
        for site in row.get("by_site", [])[:4]:
            print(
                f"sync  {name:<24} {site['per_step']:6.2f}/step  {site['kind']:<6} "
                f"[{site['thread']}] {site['where']}"
            )
    print()
    bar_rows = [[b["bar"], b["measured"], b["verdict"]] for b in result["bars"]]
    header = ["bar", "measured", "verdict"]
    print("\n".join(["bars (from the issue)", *table(header, bar_rows, (0, 1, 2))]))
    print()
    print(report(result, items))
    elapsed = result["seconds"]
    cuda = result["env"]["device_type"] == "cuda"
    over = f" (over the {BUDGET_S:.0f}s budget)" if cuda and elapsed > BUDGET_S else ""
    print(f"\n{elapsed:.0f}s elapsed{over}; every number in {out}")
