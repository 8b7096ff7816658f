"""OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics, and /v1/hybridpd/stats (actor pool accounting).

Errors are JSON ``{"error": {"message", "type", "code"}}`` with the status from
``hybridpd.errors.http_status``; body validation errors are 400. The server
gives every request its own id (``request_builder.new_request_id``: the
response's ``cmpl-<id>``); every response carries ``X-Request-Id``: the
client's own (the body's ``request_id``, else its header, at most 128
characters), echoed and logged escaped, or else the server's. The outer
layer (:class:`Gate`, plain ASGI) reads the whole body first, counting the bytes
read (chunked bodies too): past 8 MiB the request is a 413 and reaches no handler.
A generation request is admitted before it is tokenized (``choices.run_request``);
a non-streaming one whose client disconnects is cancelled, and with it its work on
every actor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
from services.router.choices import Choice, run_request
from services.router.openai_format import Kind, LogprobOptions, ResponseWriter, usage_json
from services.router.openai_models import ChatCompletionRequest, CompletionRequest, ErrorResponse, _Common
from services.router.openai_sampling import sampling_of
from services.router.orchestrator import Orchestrator
from services.router.output import Event, OutputOptions, Usage
from services.router.request_builder import MAX_REQUEST_ID_CHARS, ApiRequest, new_request_id
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
    state = app.state.hybridpd = RouterState(orch, served_model, stats, ApiKeys(orch.cfg.api_keys))
    app.add_middleware(Gate, state=state)
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_unexpected)
    app.add_exception_handler(HybridPDError, on_error)  # type: ignore[arg-type]
    app.include_router(router)
    app.include_router(tokens_api.router)
    return app


# -- the outer layer and error handlers -------------------------------------------------
class Gate:
    """Plain ASGI, around every HTTP request: ``X-Request-Id`` on every response, the
    body read whole before any handler and refused past :data:`MAX_BODY_BYTES` (413,
    counted on the bytes read: a chunked body too), API keys on ``KEYED_PATHS`` (401)."""

    def __init__(self, app: ASGIApp, state: RouterState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        client = headers.get("x-request-id")
        if client is not None and len(client) > MAX_REQUEST_ID_CHARS:
            client = None  # not echoed: an id is no place for a payload
        local = scope.setdefault("state", {})
        local.update(request_id=new_request_id(), client_id=client, tenant=None)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":  # the client's id (a handler may set it), or ours
                MutableHeaders(scope=message)["X-Request-Id"] = local["client_id"] or local["request_id"]
            await send(message)

        size = headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            await _too_large()(scope, receive, send_with_id)
            return
        body = await _read_body(receive)
        if body is None:  # the client went away while sending it
            return
        if len(body) > MAX_BODY_BYTES:
            await _too_large()(scope, receive, send_with_id)
            return
        try:
            if scope["path"].startswith(KEYED_PATHS):  # /health, /metrics, /docs, /version stay open
                local["tenant"] = self.state.keys.tenant(headers.get("authorization"))
        except AuthError as exc:
            resp = _error(401, str(exc), "authentication_error", {"WWW-Authenticate": "Bearer"})
            await resp(scope, receive, send_with_id)
            return
        await self.app(scope, _replay(body, receive), send_with_id)


def _too_large() -> JSONResponse:
    return _error(413, "request body over %d bytes" % MAX_BODY_BYTES, "invalid_request_error")


async def _read_body(receive: Receive) -> bytes | None:
    """The request's body, read until its end or until it is past :data:`MAX_BODY_BYTES`
    (then what was read: the caller refuses it); None if the client disconnected."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY_BYTES or not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body already read, then the client's own messages
    (its disconnect: ``_until_disconnected``)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


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
    if body.echo and base.sampling.logprobs is not None:
        raise InvalidRequestError("echo: not supported together with logprobs (prompt logprobs are not computed)")
    apis = [
        replace(
            base,
            text=p if isinstance(p, str) else None,
            token_ids=tuple(p) if isinstance(p, list) else None,
            checkpoints=tuple(body.hybridpd_checkpoints or ()),
            add_special_tokens=body.add_special_tokens,
            echo=bool(body.echo),
        )
        for p in body.prompts()
    ]
    return await _generate(st, request, body, apis, "completions")


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat(body: ChatCompletionRequest, request: Request, st: State) -> Response:
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
        _api_request(body, request, st),
        messages=msgs,
        answer_checkpoint=body.hybridpd_answer_checkpoint,
        chat=opts,
        echo=body.echo,
    )
    return await _generate(st, request, body, [api], "chat")


def _api_request(body: _Common, request: Request, st: RouterState) -> ApiRequest:
    """The fields both endpoints share (``request_builder.build`` decides the rest)."""
    sampling = sampling_of(body, st.orch.tokenizer.generation_defaults)
    if body.request_id:  # vLLM's body field: echoed, as the header is
        request.state.client_id = body.request_id
    output = OutputOptions(
        body.stop_list(),
        body.include_stop_str_in_output,
        body.min_tokens,
        body.skip_special_tokens,
        tuple(body.stop_token_ids or ()),
    )
    return ApiRequest(
        request.state.request_id,
        body.model or st.served_model,
        sampling,
        cache_salt=body.cache_salt,
        tenant=request.state.tenant,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side or "left",
        output=output,
        client_id=request.state.client_id,
    )


async def _generate(st: RouterState, request: Request, body: _Common, apis: list[ApiRequest], kind: Kind) -> Response:
    """Run every choice of the request (``choices.run_request``: admitted, then built
    off the event loop): an SSE stream, or one JSON body once all finished."""
    created = int(time.time())
    first = apis[0]
    oid = ("chatcmpl-" if kind == "chat" else "cmpl-") + first.request_id
    n = body.choices
    lp = LogprobOptions(first.sampling.logprobs, bool(body.return_tokens_as_token_ids))
    model = body.model or st.served_model
    writer = ResponseWriter(kind, st.orch.tokenizer, oid, created, model, lp, bool(body.return_token_ids))

    def built(choices: list[Choice]) -> None:
        echo = {c.index: c.built.echo for c in choices if c.built.echo is not None}
        writer.prepare(echo, {c.index: c.built.request.prompt_token_ids for c in choices})

    force = body.hybridpd_prefill_instance
    events = run_request(st.orch, apis, n, kind, st.served_model, force, built)
    if body.stream:
        head = await anext(events)  # errors before the first token become a proper HTTP status
        return StreamingResponse(_sse(head, events, writer, body, n), media_type="text/event-stream")
    collect = asyncio.ensure_future(_collect(events, writer, n))
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():  # the client went away: the request's work is aborted on every actor
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
    if collect.cancelled():
        return Response(status_code=499)  # nobody reads it
    return JSONResponse(collect.result())


async def _collect(events: AsyncIterator[tuple[int, Event]], writer: ResponseWriter, n: int) -> dict[str, Any]:
    """A non-streaming response's body, once every choice finished."""
    usages: dict[int, Usage] = {}
    async for index, ev in events:
        writer.add(index, ev)
        if ev.usage is not None:
            usages[index] = ev.usage
    return writer.body(usage_json(usages, n))


async def _until_disconnected(request: Request) -> None:
    """Returns when the client disconnects (its body was read: ``Gate``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
