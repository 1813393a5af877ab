"""Reading a request body: bounded while it arrives, strict UTF-8, a JSON object of bounded shape."""

from __future__ import annotations

import json
import sys
from typing import Any

from starlette.requests import ClientDisconnect, Request

from strata.serve.errors import ApiError, bad_request, short_repr
from strata.serve.json_bounds import check_structure, check_text

JSON_MEDIA_TYPE = "application/json"


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body parsed as one JSON object; 413 past ``max_bytes``, 400 for anything not JSON."""
    return parse_json_object(await read_limited(request, max_bytes))


def require_json_content_type(content_type: str | None) -> None:
    """``application/json``, with no charset or ``charset=utf-8``: the body is read as UTF-8."""
    media_type, *params = (content_type or "").split(";")
    if media_type.strip().lower() != JSON_MEDIA_TYPE:
        sent = f"Content-Type {short_repr(content_type)}" if content_type else "no Content-Type"
        raise ApiError(415, f"the request body must be sent as {JSON_MEDIA_TYPE}, got {sent}",
                       code="unsupported_media_type")
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise ApiError(415, f"the request body must be UTF-8, got charset {short_repr(value.strip())}",
                           code="unsupported_media_type")


async def read_limited(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > max_bytes):
        raise _too_large(int(declared[:19]), max_bytes)
    chunks, num_bytes = [], 0
    try:
        async for chunk in request.stream():
            num_bytes += len(chunk)
            if num_bytes > max_bytes:  # a body sent without Content-Length, or longer than declared
                raise _too_large(num_bytes, max_bytes, is_partial=True)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body", code="client_disconnected") from None
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})",
                          code="invalid_encoding") from None
    check_structure(raw)
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        reason = exc.msg.removesuffix(" at")  # "Invalid control character at"
        raise bad_request(f"the request body is not valid JSON: {reason} at line {exc.lineno} column {exc.colno}",
                          code="invalid_json") from None
    except (ValueError, RecursionError) as exc:
        is_too_long = "integer string conversion" in str(exc)  # Python's limit (sys.get_int_max_str_digits)
        reason = f"an integer of more than {sys.get_int_max_str_digits():,} digits" if is_too_long else exc
        raise bad_request(f"the request body is not valid JSON: {reason}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    check_text(raw, value)
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _too_large(num_bytes: int, max_bytes: int, is_partial: bool = False) -> ApiError:
    size = f"more than {max_bytes:,}" if is_partial else f"{num_bytes:,}"
    # closing the connection stops the upload; otherwise the server would have to drain the rest to keep it alive
    return ApiError(413, f"the request body has {size} bytes; the limit is {max_bytes:,} (serve.max_body_bytes)",
                    code="request_too_large", headers={"Connection": "close"})
