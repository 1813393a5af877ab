"""One generation request, from body to response: check, tokenize, queue, wait, answer.

Everything that can be refused is refused before the request takes a place in the queue. The
status line goes out only once the engine has produced the first event, so a request whose
prefill fails still gets a 500 even when it asked for a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import urllib.parse
import uuid
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from strata.errors import ConfigError, NonFiniteLogitsError, RequestError
from strata.serve import sse
from strata.serve.body import read_json_object, require_json_content_type
from strata.serve.errors import ApiError, bad_request, busy, model_not_found
from strata.serve.middleware import RECEIVED_AT_KEY
from strata.serve.responses import PickLog, ResponseShapes
from strata.serve.schemas import Kind, parse_request
from strata.serve.worker import (
    CLIENT_CLOSED,
    DONE,
    ERROR,
    TOKEN,
    Job,
    QueueFullError,
    WorkerStoppedError,
)

RETRY_AFTER_S = 1
CLIENT_CLOSED_STATUS = 499  # the client went away before its answer: counted apart from the server's refusals
MAX_HEADER_CHARS = 1024
_ID_PREFIX = {"completion": "cmpl-", "chat": "chatcmpl-"}


async def handle_generation(request: Request, kind: Kind) -> Response:
    state = request.app.state.serve
    require_json_content_type(request.headers.get("content-type"))
    ready = state.require_ready()
    body = await read_json_object(request, state.config.serve.max_body_bytes)
    parsed = parse_request(body, kind)
    if parsed.model != ready.model_name:
        raise model_not_found(parsed.model, ready.model_name)
    prepared = await run_in_threadpool(ready.prompts.prepare, parsed)

    request_id = _ID_PREFIX[kind] + uuid.uuid4().hex[:24]
    channel = sse.JobChannel(asyncio.get_running_loop())
    job = Job(request_id, request.url.path, prepared.tokens, prepared.params, channel.sink)
    try:
        ready.worker.submit(job)
    except QueueFullError as exc:
        raise busy(f"the server is busy: {exc}; retry later", "queue_full", RETRY_AFTER_S) from None
    except WorkerStoppedError as exc:
        raise busy(str(exc), exc.code, RETRY_AFTER_S) from None

    headers = {"x-request-id": request_id}
    ignored = ignored_params_header(parsed.ignored_params)
    if ignored:  # every name empty or too long: no header rather than an empty one
        headers["x-strata-ignored-params"] = ignored
    is_logprobs = prepared.params.num_logprobs is not None
    shapes = ResponseShapes(kind, request_id, ready.model_name, parsed.is_usage_streamed,
                            ready.prompts.token_text if is_logprobs else None)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
    telemetry = state.telemetry
    try:
        first = await channel.get()
        if first[0] == ERROR:
            raise to_api_error(first[1], request_id)
        if first[0] == TOKEN:
            telemetry.record_first_token(time.perf_counter() - request.scope[RECEIVED_AT_KEY])
        if parsed.is_stream:
            stream = sse.event_stream(channel, first, job, shapes, functools.partial(to_api_error,
                                                                                     request_id=request_id),
                                      telemetry, prepared.echo_text)
            return StreamingResponse(stream, media_type="text/event-stream", headers={**headers, **sse.HEADERS})
        text, stats, picks = await _collect(channel, first, request_id, len(prepared.echo_text))
        telemetry.record_generation(stats)
        return JSONResponse(shapes.complete(prepared.echo_text + text, stats, picks), headers=headers)
    except BaseException:
        job.cancel()
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def ignored_params_header(names: tuple[str, ...]) -> str:
    """The names percent-encoded (UTF-8), comma-separated, whole names up to MAX_HEADER_CHARS: a
    header value is Latin-1 without CR or LF, and a parameter name may be any JSON string."""
    kept, num_chars = [], 0
    for name in (urllib.parse.quote(name, safe="") for name in names):
        if name and num_chars + len(name) + 1 <= MAX_HEADER_CHARS:  # a name too long is left out, not the rest
            num_chars += len(name) + 1
            kept.append(name)
    return ",".join(kept)


def to_api_error(exc: BaseException, request_id: str | None = None) -> ApiError:
    error = _api_error(exc, request_id)
    if request_id:
        error.headers.setdefault("x-request-id", request_id)
    return error


def _api_error(exc: BaseException, request_id: str | None) -> ApiError:
    if isinstance(exc, (ConfigError, RequestError)):
        return bad_request(str(exc))
    if isinstance(exc, WorkerStoppedError) and exc.code == CLIENT_CLOSED:  # nginx's 499: nobody reads it
        return ApiError(CLIENT_CLOSED_STATUS, str(exc), code=CLIENT_CLOSED)
    if isinstance(exc, WorkerStoppedError):
        return busy(str(exc), exc.code, RETRY_AFTER_S)
    if isinstance(exc, NonFiniteLogitsError):  # the model's fault, not the client's: no token is made up
        return ApiError(500, f"request {request_id or ''} failed: {exc}; no token was produced from them, and the "
                             "server goes on serving", code="non_finite_logits")
    return ApiError(500, f"the engine failed on this request ({type(exc).__name__}: {exc}); its loaned resources "
                         "were restored and the next request is served", code="engine_error")


async def _collect(channel: sse.JobChannel, first: tuple[str, Any], request_id: str,
                   text_offset: int = 0) -> tuple[str, Any, list]:
    """(the text, the stats, each token's (id, log-probabilities, offset of its text) where the request asked
    for them); text_offset: the length of the text before the completion's (an echoed prompt)."""
    parts, picks = [], PickLog(text_offset)
    kind, payload = first
    while kind == TOKEN:
        picks.add(payload)
        parts.append(payload.text)
        kind, payload = await channel.get()
    if kind != DONE:
        raise to_api_error(payload, request_id)
    return "".join(parts), payload, picks.take()


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """The body has been read, so the next ASGI message is the client going away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()
