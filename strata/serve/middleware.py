"""The outermost layer of every HTTP exchange: its timing and status for ``/metrics``, and the
answer to an exception that no handler took.

Such an exception is logged once, with its traceback, and answered with a 500 in the OpenAI shape,
so the connection stays open. (Starlette's own last resort answers too, but re-raises, so the
server logs the traceback a second time and drops a keep-alive connection.)
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from strata.serve.errors import ApiError
from strata.serve.telemetry import ServeTelemetry

log = logging.getLogger("strata.serve")
RECEIVED_AT_KEY = "strata.received_at"  # scope key: perf_counter() when the request arrived


class ExchangeGuard:
    def __init__(self, app: ASGIApp, telemetry: ServeTelemetry):
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received_at = scope[RECEIVED_AT_KEY] = time.perf_counter()
        status: int | None = None

        async def send_tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:  # the last resort: logged here, answered below
            log.error("unexpected error on %s %s", scope["method"], scope["path"], exc_info=exc)
            if status is None:
                error = ApiError(500, f"internal error ({type(exc).__name__}): {exc}"[:500], code="internal_error")
                await error.response()(scope, receive, send_tracked)
            else:  # the status line has gone out: the response is cut short
                self.telemetry.record_stream_failure()
        finally:
            if status is not None:
                self.telemetry.record_response(scope["path"], status, time.perf_counter() - received_at)
