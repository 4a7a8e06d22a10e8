"""`StagingStats`: what the asynchronous record path did, for `tracer.staging_stats`.

Example:
    ```python
    stats = tracer.staging_stats
    print(stats.records, stats.overflows, stats.writer_wait_seconds)
    ```
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StagingStats"]


@dataclass
class StagingStats:
    """What a `Stager` did, for `tracer.staging_stats`.

    Attributes:
        admitted: records admitted (staged or copied at once).
        staged: records cloned on a device and copied to the host asynchronously.
        kept: records that changed and were recorded.
        unchanged: records equal to the site's last one, left out.
        dropped: records dropped because the bound was reached (`on_full="drop"`).
        dropped_by_site: `dropped` per site.
        waits: admissions that waited for memory in flight (`on_full="wait"`).
        wait_seconds: the time those waits took, in total.
        max_inflight_bytes: the most bytes in flight at once.
        skipped_capturing: records skipped while a stream was capturing a graph.
        pinned: whether host buffers are pinned (`None` before the first copy).
        flushes: batches handed to the staging thread (one event per producer stream each).
        handoffs: hand-offs to the staging thread (a batch, a job, or both at once).
        wakeups: times the staging thread woke up (hand-offs seen, event polls).
        host_bytes_peak: the most bytes of host slots in use at once.
        overflows: records that found the host ring full and got memory of their own.
        device_compare_bytes: bytes of previous records held on the devices now, to compare
            the next ones with there (at most `max_device_bytes`).
        device_compare_bytes_peak: the most of those bytes held at once.
        host_compares: staged records compared on the host, their sites' previous records
            not fitting in `max_device_bytes` on the device.
        writer_wait_seconds: the time the staging thread waited, before delivering records,
            for a background saver's writer to make room for them (`make_room`).
    """

    admitted: int = 0
    staged: int = 0
    kept: int = 0
    unchanged: int = 0
    dropped: int = 0
    dropped_by_site: dict[str, int] = field(default_factory=dict)
    waits: int = 0
    wait_seconds: float = 0.0
    max_inflight_bytes: int = 0
    skipped_capturing: int = 0
    pinned: bool | None = None
    flushes: int = 0
    handoffs: int = 0
    wakeups: int = 0
    host_bytes_peak: int = 0
    overflows: int = 0
    device_compare_bytes: int = 0
    device_compare_bytes_peak: int = 0
    host_compares: int = 0
    writer_wait_seconds: float = 0.0
