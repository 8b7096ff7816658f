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
from hybridpd.tokenizer import ChatMessage, ChatOptions
from services.router import tokens_api
from services.router.choices import expand, serve
from services.router.openai_format import Kind, LogprobOptions, ResponseWriter, usage_json
from services.router.openai_models import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    _Common,
)
from services.router.openai_sampling import sampling_of
from services.router.orchestrator import Orchestrator
from services.router.output import Event, OutputOptions, Usage
from services.router.request_builder import ApiRequest, Built, build
from services.worker.api import WorkerClient

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
#: paths that need an API key (when keys are configured)
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")
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
    app.include_router(tokens_api.router)
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
            if request.url.path.startswith(KEYED_PATHS):  # /health, /metrics, /docs, /version stay open
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
    base = _api_request(body, request, st)
    prompts = body.prompts()
    _check_choices(len(prompts), body.choices)
    if body.echo and base.sampling.logprobs is not None:
        raise InvalidRequestError("echo: not supported together with logprobs (prompt logprobs are not computed)")
    builts, echo = [], {}
    for i, p in enumerate(prompts):
        api = replace(
            base,
            text=p if isinstance(p, str) else None,
            token_ids=tuple(p) if isinstance(p, list) else None,
            checkpoints=tuple(body.hybridpd_checkpoints or ()),
            add_special_tokens=body.add_special_tokens,
        )
        builts.append(build(api, st.orch, st.served_model))
        if body.echo:
            text = p if isinstance(p, str) else st.orch.tokenizer.decode(p, False)  # vLLM keeps special tokens
            echo.update({i * body.choices + j: text for j in range(body.choices)})
    return await _generate(st, body, builts, "completions", echo)


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat(body: ChatCompletionRequest, request: Request, st: State) -> Response:
    _check_choices(1, body.choices)
    msgs = tuple(ChatMessage(m.role, m.text, m.name) for m in body.messages)
    tools = tuple(t.as_template() for t in body.tools) if body.tools else None
    opts = ChatOptions(
        body.add_generation_prompt,
        body.continue_final_message,
        body.chat_template_kwargs or {},
        body.add_special_tokens,
        tools,
    )
    api = replace(
        _api_request(body, request, st), messages=msgs, answer_checkpoint=body.hybridpd_answer_checkpoint, chat=opts
    )
    built = build(api, st.orch, st.served_model)
    echo = {}
    role = "assistant" if body.add_generation_prompt else msgs[-1].role  # vLLM's get_chat_request_role
    if body.echo and msgs[-1].role == role:  # vLLM: the last message, when it is the answer's role
        echo = dict.fromkeys(range(body.choices), msgs[-1].content)
    return await _generate(st, body, [built], "chat", echo)


def _check_choices(prompts: int, n: int) -> None:
    if prompts * n > MAX_CHOICES:
        raise InvalidRequestError(
            "n: at most %d choices per request (prompts x n), got %d" % (MAX_CHOICES, prompts * n)
        )


def _api_request(body: _Common, request: Request, st: RouterState) -> ApiRequest:
    """The fields both endpoints share (``request_builder.build`` decides the rest)."""
    sampling = sampling_of(body, st.orch.tokenizer.generation_defaults)
    rid, tenant = body.request_id or request.state.request_id, request.state.tenant
    return ApiRequest(
        rid,
        body.model or st.served_model,
        sampling,
        cache_salt=body.cache_salt,
        tenant=tenant,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side or "left",
    )


async def _generate(
    st: RouterState, body: _Common, builts: list[Built], kind: Kind, echo: dict[int, str] | None = None
) -> Response:
    """Run every choice of the request: an SSE stream, or one JSON body once all finished."""
    created = int(time.time())
    first = builts[0].request
    oid = ("chatcmpl-" if kind == "chat" else "cmpl-") + first.request_id
    n = body.choices
    lp = LogprobOptions(first.sampling.logprobs, bool(body.return_tokens_as_token_ids))
    model = body.model or st.served_model
    choices = expand(builts, n)
    prompts = {c.index: c.built.request.prompt_token_ids for c in choices}
    writer = ResponseWriter(
        kind, st.orch.tokenizer, oid, created, model, lp, bool(body.return_token_ids), echo, prompts
    )
    client_stops = tuple(body.stop_token_ids or ())
    opts = OutputOptions(
        body.stop_list(), body.include_stop_str_in_output, body.min_tokens, body.skip_special_tokens, client_stops
    )
    events = serve(st.orch, choices, kind, body.hybridpd_prefill_instance, opts)
    if body.stream:
        head = await anext(events)  # errors before the first token become a proper HTTP status
        return StreamingResponse(_sse(head, events, writer, body, n), media_type="text/event-stream")
    usages: dict[int, Usage] = {}
    async for index, ev in events:
        writer.add(index, ev)
        if ev.usage is not None:
            usages[index] = ev.usage
    return JSONResponse(writer.body(usage_json(usages, n)))


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


async def _sse(
    head: tuple[int, Event], rest: AsyncIterator[tuple[int, Event]], writer: ResponseWriter, body: _Common, n: int
) -> AsyncIterator[bytes]:
    usages: dict[int, Usage] = {}

    def data(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def chunk(index: int, ev: Event) -> bytes:
        if ev.usage is not None:
            usages[index] = ev.usage
        return data(writer.chunk(index, ev))

    yield chunk(*head)
    try:
        async for index, ev in rest:
            yield chunk(index, ev)
    except HybridPDError as exc:
        # NOTE: the status line is already sent: report the failure in-stream and
        # end WITHOUT [DONE], so no client mistakes a cut stream for a finished one.
        err = {"error": {"message": describe(exc), "type": type(unwrap(exc)).__name__, "code": int(http_status(exc))}}
        yield data(err)
        return
    finally:
        await rest.aclose()  # type: ignore[attr-defined]  # a disconnect lands here: the actors are aborted
    if body.include_usage and usages:
        yield data(writer.usage_chunk(usage_json(usages, n)))
    yield b"data: [DONE]\n\n"
