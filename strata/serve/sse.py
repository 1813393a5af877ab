"""Server-sent events: the engine's tokens as OpenAI stream chunks, ``data: {...}`` frames ending in
``data: [DONE]`` (after an error event too, so a client reading up to ``[DONE]`` always stops).

The stream is the only place a client disconnect is seen once streaming has begun (Starlette
cancels the body iterator), so leaving the iterator early cancels the job: the engine stops at its
next token and takes the next request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from strata.serve.errors import ApiError
from strata.serve.responses import PickLog, ResponseShapes
from strata.serve.telemetry import ServeTelemetry
from strata.serve.worker import ERROR, TOKEN, Job

DONE_FRAME = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class JobChannel:
    """Carries a job's events from the engine thread to the request's coroutine."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def sink(self, kind: str, payload: Any) -> None:
        """Called on the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed: the server is gone, nobody is listening
            pass

    async def get(self) -> tuple[str, Any]:
        return await self._queue.get()


async def event_stream(channel: JobChannel, first: tuple[str, Any], job: Job, shapes: ResponseShapes,
                       to_api_error, telemetry: ServeTelemetry, echo_text: str = "") -> AsyncIterator[bytes]:
    """The frames of one stream, starting from the job's first event (already received); a completion's
    echoed prompt first. A token whose text is held back (an open UTF-8 sequence, a possible stop string)
    has its log-probabilities sent with the next text."""
    is_finished = False
    try:
        opening = shapes.opening_chunk()
        if opening is not None:
            yield frame(opening)
        if echo_text:
            yield frame(shapes.text_chunk(echo_text))
        kind, payload = first
        picks = PickLog(len(echo_text))
        while kind == TOKEN:
            picks.add(payload)
            if payload.text:
                yield frame(shapes.text_chunk(payload.text, picks.take()))
            kind, payload = await channel.get()
        is_finished = True
        if kind == ERROR:
            # the status line has gone out already: the error travels as an event, as the OpenAI API sends it
            error: ApiError = to_api_error(payload)
            if error.status == 500:  # a 503 (shutting down) is a refusal, not a failure
                telemetry.record_stream_failure()
            yield frame(error.body())
        else:
            telemetry.record_generation(payload)
            yield frame(shapes.final_chunk(payload, picks.take()))
            if shapes.is_usage_streamed:
                yield frame(shapes.usage_chunk(payload))
        yield DONE_FRAME
    finally:
        if not is_finished:
            job.cancel()
