"""Step times of ``gpu_check.py``'s contenders over interleaved rounds, with their memory, CPU
and staging stats; and the device's copy bandwidth."""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import time
from typing import Any

import torch
from _harness import alternated

from _gpu.contenders import Capture, Contender
from _gpu.logs import describe, log
from _gpu.model import Plan, Trainer, allocated, peak, synchronize


def merge_stats(total: dict[str, Any], new: dict[str, Any]) -> None:
    """Add one run's ``staging_stats`` to ``total`` (counts summed, high-water marks maxed)."""
    for key, value in new.items():
        if isinstance(value, dict):
            merge_stats(total.setdefault(key, {}), value)
        elif isinstance(value, bool) or not isinstance(value, int | float):
            total[key] = value
        elif key.startswith("max"):
            total[key] = max(total.get(key, value), value)
        else:
            total[key] = total.get(key, 0) + value


def time_contenders(trainer: Trainer, items: list[Contender], plan: Plan) -> dict[str, Any]:
    """Step times, exit (drain) times, extra peak memory and staging stats of each contender."""
    device = trainer.device
    times: dict[str, list[float]] = {c.name: [] for c in items}
    main_cpu: dict[str, list[float]] = {c.name: [] for c in items}  # the training thread's
    other_cpu: dict[str, list[float]] = {c.name: [] for c in items}  # every other thread's
    rss_growth = dict.fromkeys(times, 0)
    exits: dict[str, list[float]] = {c.name: [] for c in items}
    peaks = dict.fromkeys(times, 0)
    rows: dict[str, dict[str, Any]] = {c.name: {} for c in items}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    rounds = 0
    while rounds < plan.max_rounds:
        for c in alternated(items, rounds):
            if "error" in rows[c.name]:
                continue
            capture = Capture(trainer)
            synchronize(device)
            base = allocated(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            resident = resident_bytes()
            try:
                with c.enter(capture):
                    for _ in range(plan.warm):
                        trainer.step()
                    synchronize(device)
                    for _ in range(plan.steps):
                        start = time.perf_counter()
                        thread, process = time.thread_time(), time.process_time()
                        trainer.step()
                        synchronize(device)
                        times[c.name].append(time.perf_counter() - start)
                        mine = time.thread_time() - thread
                        main_cpu[c.name].append(mine)
                        other_cpu[c.name].append(time.process_time() - process - mine)
                    rss_growth[c.name] = max(rss_growth[c.name], resident_bytes() - resident)
                    leaving = time.perf_counter()
                synchronize(device)
                exits[c.name].append(time.perf_counter() - leaving)
            except Exception as error:  # one broken contender must not stop the others
                rows[c.name]["error"] = describe(error)
                log(f"  {c.name}: {rows[c.name]['error']}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            peaks[c.name] = max(peaks[c.name], peak(device) - base)
            merge_stats(rows[c.name], capture.stats)
        rounds += 1
        spent = time.perf_counter() - began
        log(f"  round {rounds}/{plan.max_rounds}: {spent:.0f}s of {plan.timing_s:.0f}s")
        if spent * (rounds + 1) / rounds > plan.timing_s and rounds < plan.max_rounds:
            log(f"  stopping after {rounds} rounds: another would exceed the timing budget")
            break
    if not times["untraced"]:
        sys.exit(f"the untraced step failed: {rows['untraced'].get('error')}")
    base_mean = statistics.fmean(times["untraced"])
    base_median = statistics.median(times["untraced"])
    for name, samples in times.items():
        if samples:
            rows[name].update(
                mean_ms=1e3 * statistics.fmean(samples),
                median_ms=1e3 * statistics.median(samples),
                max_ms=1e3 * max(samples),
                steps=len(samples),
                ratio=statistics.fmean(samples) / base_mean,
                ratio_median=statistics.median(samples) / base_median,
                exit_ms=1e3 * statistics.fmean(exits[name]),
                main_cpu_ms=1e3 * statistics.fmean(main_cpu[name]),
                other_cpu_ms=1e3 * statistics.fmean(other_cpu[name]),
                rss_growth_mib=rss_growth[name] / 2**20,
                peak_extra_mib=(peaks[name] - peaks["untraced"]) / 2**20,
            )
        if "h5_mib" in rows[name]:  # every step of every run wrote to a file
            written = len(exits[name]) * (plan.warm + plan.steps)
            rows[name]["h5_mib_per_step"] = rows[name]["h5_mib"] / max(1, written)
    host: dict[str, Any] = {
        "rounds": rounds,
        "max_rss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024,
    }
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            host["pinned_mib"] = (
                torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / 2**20
            )
    return {"contenders": rows, "host": host}


def resident_bytes() -> int:
    """The process's resident memory now (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def bandwidth(device: torch.device) -> dict[str, float]:
    """Device-to-device and device-to-host copy rates of a 151 MiB tensor, GB/s."""
    source = torch.randn(151 << 18, device=device)
    pageable, pinned = torch.empty(151 << 18), torch.empty(151 << 18, pin_memory=True)
    copies = {
        "d2d_clone": lambda: source.clone(),
        "d2h_pageable": lambda: pageable.copy_(source),
        "d2h_pinned": lambda: pinned.copy_(source, non_blocking=True),
    }
    out = {}
    for name, copy in copies.items():
        copy()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(5):
            copy()
        synchronize(device)
        out[f"{name}_GBps"] = round(5 * (151 << 20) / (time.perf_counter() - start) / 1e9, 1)
    return out
