"""Errors the API answers with, in the OpenAI shape ``{"error": {message, type, param, code}}``.

The official clients read ``error.message`` and ``error.code``; curl users read the message, so
every message says what was wrong and what is accepted.
"""

from __future__ import annotations

import reprlib
from typing import Mapping

from fastapi.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class ApiError(Exception):
    """An HTTP error with the OpenAI error body; raised anywhere in a route, answered by the app."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def invalid_type(param: str, expected: str, value: object) -> ApiError:
    return bad_request(f"'{param}' must be {expected}, got {_json_type(value)} {short_repr(value)}", param=param,
                       code="invalid_type")


def model_not_found(asked: object, served: str) -> ApiError:
    return ApiError(404, f"the model {short_repr(asked)} does not exist; this server serves '{served}'", param="model",
                    code="model_not_found")


def busy(message: str, code: str, retry_after_s: int) -> ApiError:
    return ApiError(503, message, code=code, headers={"Retry-After": str(retry_after_s)})


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def short_repr(value: object, limit: int = 60) -> str:
    """A value for an error message, never longer than ``limit``: a client's value may be megabytes."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an integer past Python's 4,300-digit printing limit
        text = "(a number too long to print)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bounded_repr() -> reprlib.Repr:
    bounded = reprlib.Repr()
    bounded.maxlevel, bounded.maxlist, bounded.maxdict = 2, 4, 4
    bounded.maxstring = bounded.maxlong = bounded.maxother = 60
    return bounded


_REPR = _bounded_repr()
