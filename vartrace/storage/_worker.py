"""A background thread that runs jobs in order: the saver's writes, off the training thread.

Example:
    ```python
    worker = Worker("vartrace-writer")
    worker.submit(lambda: write_gather(chunk))  # returns at once (blocks if ``depth`` are queued)
    worker.join()                               # every job ran; re-raises a job's error
    worker.stop()
    ```

At most `depth` jobs wait in the queue, so the caller blocks rather than
let memory grow when the thread falls behind.  The first exception a job
raises is kept; later jobs are skipped, and `Worker.submit`,
`Worker.join` and `Worker.stop` raise it in the caller's thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from vartrace.errors import WorkerError

__all__ = ["Worker", "WorkerError"]

_STOP = object()


class Worker:
    """One daemon thread running submitted jobs in submission order."""

    def __init__(self, name: str, depth: int = 1) -> None:
        self._jobs: queue.Queue[Callable[[], None] | object] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                if self._error is None:
                    job()  # type: ignore[operator]
            except BaseException as exc:  # kept and raised in the caller's thread
                self._error = exc
            finally:
                self._jobs.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            raise WorkerError(f"a background job failed: {self._error!r}") from self._error

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`; raise the error of an earlier job instead, if one failed."""
        self._raise()
        if not self._thread.is_alive():
            raise RuntimeError("the worker is stopped")
        self._jobs.put(job)

    def join(self) -> None:
        """Wait until every submitted job ran; raise the first error of one."""
        self._jobs.join()
        self._raise()

    def stop(self) -> None:
        """Run what is queued, end the thread, and raise the first error of a job."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join()
        self._raise()
