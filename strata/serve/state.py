"""The server's life: loading in the background, ready with an engine and its worker, or failed.

The HTTP server answers from the first moment (``/health`` says 503 while the model loads), so a
supervisor sees the process alive during a load that takes minutes for a large model.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from strata.config import Config
from strata.serve.errors import busy
from strata.serve.prompts import PromptBuilder
from strata.serve.telemetry import ServeTelemetry
from strata.serve.worker import EngineWorker

log = logging.getLogger("strata.serve")

LOADING, READY, FAILED, STOPPING, STOPPED = "loading", "ready", "failed", "shutting_down", "stopped"
LOADING_RETRY_AFTER_S = 5


@dataclasses.dataclass(frozen=True)
class Ready:
    engine: Any
    worker: EngineWorker
    prompts: PromptBuilder
    model_name: str


class ServeState:
    def __init__(self, config: Config, engine_loader: Callable[[], Any]):
        self.config = config
        self._engine_loader = engine_loader
        self._lock = threading.Lock()
        self.phase = LOADING
        self.started_at = time.time()
        self.load_error: str | None = None
        self.telemetry = ServeTelemetry()
        self._ready: Ready | None = None
        self._thread = threading.Thread(target=self._load, name="strata-load", daemon=True)

    def start_loading(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> Ready | None:
        return self._ready

    def require_ready(self) -> Ready:
        ready = self._ready
        if self.phase in (STOPPING, STOPPED):
            raise busy("the server is shutting down", "shutting_down", LOADING_RETRY_AFTER_S)
        if ready is not None and ready.worker.fatal_error:
            raise busy(f"the engine is unhealthy ({ready.worker.fatal_error}); restart the server",
                       "engine_unhealthy", LOADING_RETRY_AFTER_S)
        if ready is not None:
            return ready
        if self.phase == FAILED:
            raise busy(f"the model failed to load: {self.load_error}", "model_load_failed", LOADING_RETRY_AFTER_S)
        raise busy("the model is loading; retry shortly (GET /health says when it is ready)", "model_loading",
                   LOADING_RETRY_AFTER_S)

    def begin_shutdown(self) -> None:
        """The server stops taking requests: the running one ends at its next token and every
        waiting one at once, each with a ``shutting_down`` error. Returns without waiting."""
        with self._lock:
            ready = self._ready
            if self.phase in (LOADING, READY):
                self.phase = STOPPING
        if ready is not None:
            ready.worker.stop(timeout_s=0)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            ready, self._ready = self._ready, None
            self.phase = STOPPED
        if ready is not None:
            ready.worker.stop(timeout_s)
            ready.engine.close()

    def _load(self) -> None:
        try:
            engine = self._engine_loader()
        except BaseException as exc:  # noqa: BLE001 -- reported through /health and the log
            with self._lock:
                self.phase, self.load_error = FAILED, f"{type(exc).__name__}: {exc}"
            log.error("loading the model failed: %s", self.load_error)
            return
        try:
            log.info("%s", engine.format_placement())
            log.info("%s", engine.format_plan())
            ready = Ready(engine, EngineWorker(engine, self.config.serve.max_queue),
                          PromptBuilder(engine.tokenizer, engine.context_tokens,
                                        self.config.serve.parse_special_in_content), engine.model_name)
        except BaseException as exc:  # noqa: BLE001
            engine.close()
            with self._lock:
                self.phase, self.load_error = FAILED, f"{type(exc).__name__}: {exc}"
            log.error("the loaded model cannot be served: %s", self.load_error)
            return
        with self._lock:
            if self.phase != LOADING:  # shut down while loading
                engine.close()
                return
            ready.worker.start()
            self._ready, self.phase = ready, READY
        log.info("serving model '%s' (context %d tokens)", ready.model_name, engine.context_tokens)
