"""OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions,
/v1/models, /health (liveness), /ready (readiness), /metrics, and
/v1/hybridpd/stats (actor pool accounting).

The outer layer (body size, request ids, API keys) and the error handlers are
``http_gate``'s: errors are JSON ``{"error": {"message", "type", "code"}}`` with
the status from ``hybridpd.errors.http_status``; body validation errors are 400.
The server gives every request its own id (``request_builder.new_request_id``:
the response's ``cmpl-<id>``); every response carries ``X-Request-Id``: the
client's own (the body's ``request_id``, else its header, at most 128
characters), echoed and logged escaped, or else the server's. A generation
request is admitted before it is tokenized (``choices.run_request``); a
non-streaming one whose client disconnects is cancelled, and with it its work on
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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hybridpd.auth import ApiKeys, sees_cache_details
from hybridpd.errors import HybridPDError, InvalidRequestError, NotFoundError, http_status, public_message, public_type
from hybridpd.tokenizer import ChatMessage, ChatOptions
from services.router import http_gate, tokens_api
from services.router.choices import Choice, run_request
from services.router.http_gate import error_response
from services.router.openai_format import Kind, LogprobOptions, ResponseWriter, usage_json
from services.router.openai_models import ChatCompletionRequest, CompletionRequest, ErrorResponse, _Common
from services.router.openai_sampling import sampling_of
from services.router.orchestrator import Orchestrator
from services.router.output import Event, OutputOptions, Usage
from services.router.request_builder import ApiRequest
from services.worker.api import WorkerClient

logger = logging.getLogger(__name__)

#: fault -> the kind of instance it is injected into
FAULT_KINDS = {
    "corrupt_next_handoff": "prefill",
    "forge_next_handoff": "prefill",
    "delay_next_handoff_read": "decode",
}

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
    state = app.state.hybridpd = RouterState(orch, served_model, stats, ApiKeys.from_config(orch.cfg))
    http_gate.install(app, state.keys, orch.cfg.metrics_need_key)
    app.include_router(router)
    app.include_router(tokens_api.router)
    return app


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
    details = sees_cache_details(st.orch.cfg.cache_details, request.state.caller)
    tok = st.orch.tokenizer
    writer = ResponseWriter(kind, tok, oid, created, model, lp, bool(body.return_token_ids), cache_details=details)

    def built(choices: list[Choice]) -> None:
        echo = {c.index: c.built.echo for c in choices if c.built.echo is not None}
        writer.prepare(echo, {c.index: c.built.request.prompt_token_ids for c in choices})

    force = body.hybridpd_prefill_instance
    events = run_request(st.orch, apis, n, kind, st.served_model, force, built)
    if body.stream:
        head = await anext(events)  # errors before the first token become a proper HTTP status
        sse = _sse(head, events, writer, body, n, first.request_id)
        return StreamingResponse(sse, media_type="text/event-stream")
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
    return writer.body(usage_json(usages, n, writer.cache_details))


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
    """Liveness: ok while this process serves HTTP."""
    return {"status": "ok"}


@router.get("/ready", responses={503: {**_ERR, "description": "No live prefill or decode instance, or draining"}})
async def ready(st: State) -> Response:
    """Readiness (``Orchestrator.readiness``): 200 while a prefill and a decode instance
    are live and the router is not draining; else 503 with the reason."""
    reason = await st.orch.readiness()
    if reason is not None:
        return error_response(503, "not ready: %s" % reason, "unavailable")
    return JSONResponse({"status": "ready"})


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
    head: tuple[int, Event],
    rest: AsyncIterator[tuple[int, Event]],
    writer: ResponseWriter,
    body: _Common,
    n: int,
    request_id: str,
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
        message = public_message(exc, request_id)
        err = {"error": {"message": message, "type": public_type(exc), "code": int(http_status(exc))}}
        yield data(err)
        return
    finally:
        await rest.aclose()  # type: ignore[attr-defined]  # a disconnect lands here: the actors are aborted
    if body.include_usage and usages:
        yield data(writer.usage_chunk(usage_json(usages, n, writer.cache_details)))
    yield b"data: [DONE]\n\n"
