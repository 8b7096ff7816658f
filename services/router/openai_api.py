"""OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics, and /v1/hybridpd/stats (actor pool accounting).

Errors are JSON ``{"error": {"message", "type", "code"}}`` with the status from
``hybridpd.errors.http_status``; body validation errors are 400. Every
response carries ``X-Request-Id`` (the client's, if it sent one).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridpd.auth import ApiKeys
from hybridpd.engine.base import EngineRequest
from hybridpd.errors import (
    AuthError,
    HybridPDError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    describe,
    http_status,
    unwrap,
)
from hybridpd.tokenizer import ChatMessage
from services.router.answers import AnswerPlan
from services.router.openai_models import ChatCompletionRequest, CompletionRequest, ErrorResponse, _Common
from services.router.orchestrator import Orchestrator
from services.router.output import Event
from services.router.request_builder import ApiRequest, Sampling, build
from services.worker.api import WorkerClient

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
#: fault -> the kind of instance it is injected into
FAULT_KINDS = {"corrupt_next_handoff": "prefill", "delay_next_handoff_read": "decode"}

_ERR = {"model": ErrorResponse}
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {401: {**_ERR, "description": "Missing or unknown API key"}}
#: Every error status the /v1 generation routes return, each with the same JSON body.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **AUTH_RESPONSES,
    400: {**_ERR, "description": "Invalid request (body, limits, token ids)"},
    404: {**_ERR, "description": "Unknown model or prefill instance"},
    413: {**_ERR, "description": "Body over the size limit"},
    429: {**_ERR, "description": "Router at max_inflight_requests (Retry-After)"},
    503: {**_ERR, "description": "No instance can serve"},
    504: {**_ERR, "description": "Request deadline exceeded"},
}


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


@dataclass(frozen=True, slots=True)
class RouterState:
    """What the handlers serve from (``app.state.hybridpd``)."""

    orch: Orchestrator
    served_model: str
    stats: Callable[[], Awaitable[dict]]
    keys: ApiKeys


def _state(request: Request) -> RouterState:
    state: RouterState = request.app.state.hybridpd
    return state


State = Annotated[RouterState, Depends(_state)]
router = APIRouter()


def create_app(orch: Orchestrator, served_model: str, stats: Callable[[], Awaitable[dict]]) -> FastAPI:
    """The HTTP app: this module's handlers serving ``orch`` as model ``served_model``."""
    app = FastAPI(title="hybridpd", version="1", summary="OpenAI-compatible serving for hybrid LLMs")
    app.state.hybridpd = RouterState(orch, served_model, stats, ApiKeys(orch.cfg.api_keys))
    app.middleware("http")(request_id_and_limits)
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_unexpected)
    app.add_exception_handler(HybridPDError, on_error)  # type: ignore[arg-type]
    app.include_router(router)
    return app


# -- middleware and error handlers ------------------------------------------------------
async def request_id_and_limits(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """``X-Request-Id`` on every response, the body size limit (413), API keys on /v1/ (401)."""
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    request.state.request_id = rid
    size = request.headers.get("content-length")
    request.state.tenant = None
    resp: Response
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        resp = _error(413, "request body over %d bytes" % MAX_BODY_BYTES, "invalid_request_error")
    else:
        try:
            if request.url.path.startswith("/v1/"):  # /health, /metrics, /docs stay open
                keys = _state(request).keys
                request.state.tenant = keys.tenant(request.headers.get("authorization"))
            resp = await call_next(request)
        except AuthError as exc:
            resp = _error(401, str(exc), "authentication_error", {"WWW-Authenticate": "Bearer"})
    resp.headers["X-Request-Id"] = rid
    return resp


async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    msgs = ["%s: %s" % (".".join(str(p) for p in e.get("loc", ())[1:]) or "body", e.get("msg")) for e in exc.errors()]
    return _error(400, "; ".join(msgs), "invalid_request_error")


async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # body parse errors, 404 routes, 405 methods: same error shape as everything else
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return _error(exc.status_code, str(exc.detail), kind, dict(exc.headers or {}) or None)


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("request %s failed", getattr(request.state, "request_id", "?"))
    return _error(500, "internal error: %s" % type(exc).__name__, "internal_error")


async def on_error(_: Request, exc: HybridPDError) -> JSONResponse:
    status = int(http_status(exc))
    headers = {"Retry-After": "%d" % max(1, int(exc.retry_after_s))} if isinstance(exc, OverloadedError) else None
    return _error(status, describe(exc), type(unwrap(exc)).__name__, headers)


# -- generation -------------------------------------------------------------------------
@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request, st: State) -> Response:
    prompt = body.prompt
    api = replace(
        _api_request(body, request),
        text=prompt if isinstance(prompt, str) else None,
        token_ids=tuple(prompt) if isinstance(prompt, list) else None,
        checkpoints=tuple(body.hybridpd_checkpoints or ()),
    )
    built = build(api, st.orch, st.served_model)
    return await _generate(st, body, built.request, "completions", "text")


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat(body: ChatCompletionRequest, request: Request, st: State) -> Response:
    msgs = tuple(ChatMessage(m.role, m.content) for m in body.messages)
    api = replace(_api_request(body, request), messages=msgs, answer_checkpoint=body.hybridpd_answer_checkpoint)
    built = build(api, st.orch, st.served_model)
    return await _generate(st, body, built.request, "chat", "chat", built.answer, built.boundaries)


def _api_request(body: _Common, request: Request) -> ApiRequest:
    """The fields both endpoints share (``request_builder.build`` decides the rest)."""
    sampling = Sampling(
        max_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
    )
    rid, tenant = request.state.request_id, request.state.tenant
    return ApiRequest(rid, body.model, sampling, cache_salt=body.cache_salt, tenant=tenant)


async def _generate(
    st: RouterState,
    body: _Common,
    req: EngineRequest,
    api: str,
    kind: str,
    answer: AnswerPlan | None = None,
    boundaries: tuple[int, ...] = (),
) -> Response:
    """Run ``req``: an SSE stream, or one JSON body once it finished."""
    created = int(time.time())
    oid = ("chatcmpl-" if kind == "chat" else "cmpl-") + req.request_id
    events = st.orch.stream(req, api, body.hybridpd_prefill_instance, body.stop_list(), answer, boundaries)
    if body.stream:
        first = await anext(events)  # errors before the first token become a proper HTTP status
        return StreamingResponse(_sse(first, events, oid, created, body, kind), media_type="text/event-stream")
    ids: list[int] = []
    text = []
    last: Event | None = None
    async for ev in events:
        ids.extend(ev.token_ids)
        text.append(ev.text)
        last = ev
    assert last is not None and last.usage is not None
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": "".join(text)}
    else:
        choice["text"] = "".join(text)
    if body.return_token_ids:
        choice["token_ids"] = ids
    obj = "chat.completion" if kind == "chat" else "text_completion"
    data = {"id": oid, "object": obj, "created": created, "model": body.model, "choices": [choice]}
    return JSONResponse(data | {"usage": _usage(last)})


# -- the rest ---------------------------------------------------------------------------
@router.get("/v1/models", responses=AUTH_RESPONSES)
async def models(st: State) -> dict:
    card = {
        "id": st.served_model,
        "object": "model",
        "created": 0,
        "owned_by": "hybridpd",
        "max_model_len": st.orch.cfg.max_model_len,
    }
    return {"object": "list", "data": [card]}


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(st: State) -> Response:
    return Response(generate_latest(st.orch.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/hybridpd/faults", responses=ERROR_RESPONSES)
async def faults(body: dict[str, str], st: State) -> dict:
    """Test hook: {"corrupt_next_handoff": "prefill-0"} or {"delay_next_handoff_read": "decode-0"}.
    404 unless fault_injection is on."""
    orch = st.orch
    if not orch.cfg.fault_injection:
        raise NotFoundError("fault injection is disabled")
    for kind, instance in body.items():
        if kind not in FAULT_KINDS:
            raise InvalidRequestError("unknown fault %r (known: %s)" % (kind, ", ".join(FAULT_KINDS)))
        actors: Mapping[str, WorkerClient] = orch.prefill if FAULT_KINDS[kind] == "prefill" else orch.decode
        if instance not in actors:
            raise InvalidRequestError("no %s instance %r" % (FAULT_KINDS[kind], instance))
        await actors[instance].inject_fault(kind)
    return {"ok": True}


@router.get("/v1/hybridpd/stats", responses=AUTH_RESPONSES)
async def actor_stats(st: State) -> dict:
    return await st.stats()


def _usage(ev: Event) -> dict:
    u = ev.usage
    assert u is not None
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    } | (
        {"hybridpd_prefix_tokens": dict(u.prefix_tokens), "hybridpd_promised_tokens": u.promised_tokens}
        if u.prefix_tokens is not None and u.promised_tokens is not None
        else {"hybridpd_prefix_tokens": dict(u.prefix_tokens)}
        if u.prefix_tokens is not None
        else {}
    )


async def _sse(
    first: Event, rest: AsyncIterator[Event], oid: str, created: int, body: _Common, kind: str
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(ev: Event, role: bool) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": ev.finish_reason, "logprobs": None}
        if kind == "chat":
            choice["delta"] = ({"role": "assistant"} if role else {}) | {"content": ev.text}
        else:
            choice["text"] = ev.text
        if body.return_token_ids:
            choice["token_ids"] = list(ev.token_ids)
        data: dict[str, Any] = {"id": oid, "object": obj, "created": created, "model": body.model, "choices": [choice]}
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    last = first
    yield chunk(first, True)
    try:
        async for ev in rest:
            last = ev
            yield chunk(ev, False)
    except HybridPDError as exc:
        # NOTE: the status line is already sent: report the failure in-stream and
        # end WITHOUT [DONE], so no client mistakes a cut stream for a finished one.
        err = {"error": {"message": describe(exc), "type": type(unwrap(exc)).__name__, "code": int(http_status(exc))}}
        yield b"data: " + json.dumps(err).encode() + b"\n\n"
        return
    finally:
        await rest.aclose()  # type: ignore[attr-defined]  # a disconnect lands here: the actors are aborted
    if body.include_usage and last.usage is not None:
        data = {"id": oid, "object": obj, "created": created, "model": body.model, "choices": [], "usage": _usage(last)}
        yield b"data: " + json.dumps(data).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
