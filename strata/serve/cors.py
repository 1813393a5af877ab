"""Cross-origin requests from browsers, for the origins in ``serve.cors_origins`` (none by default).

A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) is answered before routing and
before the API key is checked, as browsers send it without credentials; a refused preflight gets
a 400 in the OpenAI error shape. Any request header is allowed (the official clients add their
own), and the headers a client reads are exposed.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from strata.serve.errors import ApiError, short_repr

EXPOSED_HEADERS = ("x-request-id", "x-strata-ignored-params", "retry-after")
PREFLIGHT_MAX_AGE_S = 600


class ServeCors(CORSMiddleware):
    def __init__(self, app, origins: tuple[str, ...]):
        super().__init__(app, allow_origins=list(origins), allow_methods=["GET", "POST"], allow_headers=["*"],
                         expose_headers=list(EXPOSED_HEADERS), max_age=PREFLIGHT_MAX_AGE_S)

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        refused = response.body.decode().removeprefix("Disallowed CORS ")
        origin, method = request_headers["origin"], request_headers["access-control-request-method"]
        error = ApiError(400, f"cross-origin preflight refused ({refused}): origin {short_repr(origin)}, method "
                              f"{short_repr(method)}; this server allows the origins in serve.cors_origins and the "
                              "methods GET and POST", code="cors_refused", headers=dict(response.headers))
        error.headers.pop("content-length", None)
        error.headers.pop("content-type", None)
        return error.response()
