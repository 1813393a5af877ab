"""The ASGI application: ``create_app(engine_loader, config)``.

The app starts loading the engine in the background when it starts, answers every error in the
OpenAI error shape (including the framework's own 404/405), and closes the engine on shutdown.
Every exchange passes the guard (metrics, last-resort 500) and, with ``serve.cors_origins``, CORS.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from strata.config import Config
from strata.serve.cors import ServeCors
from strata.serve.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    ApiError,
    error_body,
    short_repr,
)
from strata.serve.middleware import ExchangeGuard
from strata.serve.routes import router
from strata.serve.state import ServeState


def create_app(engine_loader: Callable[[], Any], config: Config) -> FastAPI:
    """``engine_loader`` builds the engine (``Engine.load``); it runs on a background thread."""
    state = ServeState(config, engine_loader)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.start_loading()
        try:
            yield
        finally:
            await run_in_threadpool(state.close)

    # redirect_slashes off: a trailing slash is an unknown route (404), not a redirect built from the Host header
    app = FastAPI(title="Strata", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.serve = state
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(ExchangeGuard, telemetry=state.telemetry)
    if config.serve.cors_origins:
        app.add_middleware(ServeCors, origins=config.serve.cors_origins)  # outside the guard: on its 500s too
    app.include_router(router)
    return app


async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"no route {request.method} {short_repr(request.url.path)}; see /v1/completions, " \
                  "/v1/chat/completions, /v1/models, /health, /metrics"
    else:
        message = f"{request.method} {short_repr(request.url.path)}: {exc.detail}"
    error_type = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
    return JSONResponse(error_body(message, error_type, None, _http_code(exc.status_code)),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    return ApiError(400, f"invalid request: {exc}"[:300], code="invalid_request").response()


def _http_code(status: int) -> str:
    return {404: "not_found", 405: "method_not_allowed"}.get(status, f"http_{status}")
