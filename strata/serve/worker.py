"""Serialized execution: one engine thread runs requests one at a time, in arrival order.

Requests wait in a bounded queue; a full queue refuses the newcomer at once (the route answers 503
with Retry-After) instead of letting waits grow without bound. A job cancelled while it waits is
dropped when its turn comes; a job cancelled while it runs stops at the engine's next token (in prefill,
before its next layer).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Sequence

from strata.engine.sampling import SamplingParams
from strata.errors import ConfigError, LoanRestoreError, NonFiniteLogitsError, RequestError

log = logging.getLogger("strata.serve")

# what a job's sink receives, from the engine thread
TOKEN, DONE, ERROR = "token", "done", "error"
CLIENT_CLOSED = "client_closed"  # a job its client cancelled: no one reads the answer, and no 503 is counted
Sink = Callable[[str, Any], None]


class QueueFullError(Exception):
    pass


class WorkerStoppedError(Exception):
    """The worker takes no more jobs, or this job; ``code`` says why (``shutting_down``, ``engine_stopped``,
    ``client_closed``)."""

    def __init__(self, message: str, code: str = "engine_stopped"):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(eq=False)
class Job:
    request_id: str
    route: str
    prompt_tokens: Sequence[int]
    params: SamplingParams
    sink: Sink
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    # why a job cancelled by the server (not by its client) ends: what its client gets instead of DONE
    stop_error: WorkerStoppedError | None = None

    def cancel(self, stop_error: WorkerStoppedError | None = None) -> None:
        if stop_error is not None and self.stop_error is None:
            self.stop_error = stop_error
        self._cancelled.set()

    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()


class EngineWorker:
    """Owns the engine's only caller thread. ``submit`` is called from the event loop."""

    def __init__(self, engine: Any, max_queue: int):
        self._engine = engine
        self._max_queue = max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition()
        self._running: Job | None = None
        self._is_stopping = False
        self._stop_error: WorkerStoppedError | None = None
        self.num_rejected = 0
        self.fatal_error: str | None = None  # set once the engine reports it cannot restore its state
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def is_busy(self) -> bool:
        with self._lock:
            return self._running is not None

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._is_stopping:
                raise self._stop_error or WorkerStoppedError("the engine is stopped")
            if len(self._waiting) >= self._max_queue:
                self.num_rejected += 1
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting (serve.max_queue = "
                                     f"{self._max_queue})")
            self._waiting.append(job)
            self._lock.notify()

    def stop(self, timeout_s: float = 10.0, error: WorkerStoppedError | None = None) -> None:
        """Refuse new jobs, end waiting ones and the running one with ``error``, and wait up to
        ``timeout_s`` for the thread (0: return at once; the running job stops at its next token)."""
        with self._lock:
            self._is_stopping = True
            self._stop_error = self._stop_error or error or WorkerStoppedError("the server is shutting down",
                                                                              "shutting_down")
            stop_error = self._stop_error
            dropped = list(self._waiting)
            self._waiting.clear()
            if self._running is not None:
                self._running.cancel(stop_error)
            self._lock.notify_all()
        for job in dropped:
            job.cancel(stop_error)
            job.sink(ERROR, stop_error)
        if timeout_s > 0 and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _give_up(self, reason: str) -> None:
        """A loan that could not be restored leaves the engine in an unknown state: serve nothing more."""
        self.fatal_error = reason
        log.critical("the engine is unhealthy and serves no more requests: %s", reason)
        self.stop(error=WorkerStoppedError(f"the engine is unhealthy ({reason}); restart the server"))

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                if job.is_cancelled():
                    log.info("%s %s cancelled while waiting in the queue", job.request_id, job.route)
                    job.sink(ERROR, job.stop_error or WorkerStoppedError(
                        "the client closed the connection before the request started", CLIENT_CLOSED))
                else:
                    self._execute(job)
            finally:
                with self._lock:
                    self._running = None

    def _next(self) -> Job | None:
        with self._lock:
            while not self._waiting and not self._is_stopping:
                self._lock.wait()
            if self._is_stopping:
                return None
            self._running = self._waiting.popleft()
            return self._running

    def _execute(self, job: Job) -> None:
        started = time.perf_counter()
        try:
            generation = self._engine.generate(job.prompt_tokens, job.params, job.is_cancelled)
            try:
                for event in generation:
                    job.sink(TOKEN, event)
            finally:
                generation.close()  # a sink that raised leaves the iteration: end the request now
            stats = generation.stats
        except Exception as exc:  # the engine restored its resources; this request alone fails
            log.error("%s %s failed after %.3f s: %s: %s", job.request_id, job.route, time.perf_counter() - started,
                      type(exc).__name__, exc,
                      exc_info=not isinstance(exc, (ConfigError, RequestError, NonFiniteLogitsError)))
            job.sink(ERROR, exc)
            if isinstance(exc, LoanRestoreError):
                self._give_up(f"{type(exc).__name__}: {exc}")
            return
        log.info("%s %s %s", job.request_id, job.route, stats.timing_line())
        if job.stop_error is not None:  # stopped by the server: its client learns why, not a short finish
            job.sink(ERROR, job.stop_error)
        elif stats.finish_reason == "cancelled" and job.is_cancelled():  # its client went away
            phase = "prefill" if stats.is_prefill_cut else "generation"
            job.sink(ERROR, WorkerStoppedError(f"the client closed the connection during the {phase}", CLIENT_CLOSED))
        else:
            job.sink(DONE, stats)
