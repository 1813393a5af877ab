"""The endpoints. ``/v1/*`` needs the API key when ``serve.api_key`` is set; ``/health`` and
``/metrics`` stay open for supervisors and scrapers (they reveal no prompts or outputs)."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from strata.serve.errors import ApiError, model_not_found
from strata.serve.generation import handle_generation
from strata.serve.metrics import CONTENT_TYPE, render_metrics
from strata.serve.state import LOADING_RETRY_AFTER_S, READY


def require_api_key(request: Request) -> None:
    expected = request.app.state.serve.config.serve.api_key
    if not expected:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <serve.api_key>'",
                       code="invalid_api_key", error_type="invalid_request_error",
                       headers={"WWW-Authenticate": "Bearer"})


router = APIRouter()
api = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@api.post("/completions")
async def completions(request: Request) -> Response:
    return await handle_generation(request, "completion")


@api.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await handle_generation(request, "chat")


@api.get("/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


@api.get("/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> JSONResponse:
    card = _model_card(request)
    if model_id != card["id"]:
        raise model_not_found(model_id, card["id"])
    return JSONResponse(card)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state.serve
    body = {"status": state.phase}
    ready = state.ready
    if state.phase == READY and ready is not None and not ready.worker.fatal_error:
        body |= {"model": ready.model_name, "queue_depth": ready.worker.num_waiting}
        return JSONResponse(body)
    if ready is not None and ready.worker.fatal_error:
        body = {"status": "unhealthy", "error": ready.worker.fatal_error}
    elif state.load_error:
        body["error"] = state.load_error
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(render_metrics(request.app.state.serve), media_type=CONTENT_TYPE)


def _model_card(request: Request) -> dict:
    state = request.app.state.serve
    ready = state.require_ready()
    return {"id": ready.model_name, "object": "model", "created": int(state.started_at), "owned_by": "strata",
            "context_length": ready.engine.context_tokens}


router.include_router(api)
