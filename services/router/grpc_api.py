"""gRPC ``hybridpd.v1.Generation`` (Generate, Abort) plus the standard health
service and reflection. Errors become status codes via
``hybridpd.errors.grpc_code``; a cancelled stream aborts the request.

Ids: the server gives every request its own (``request_builder.new_request_id``);
a client's ``request_id`` is echoed in every response (none sent: the server's),
and ``Abort`` of that id reaches only the requests of the caller's own key (its
tenant) that go by it, every one of them: two clients may use the same id."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import aclosing, contextmanager
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hybridpd.auth import ApiKeys, Caller, sees_cache_details
from hybridpd.engine.base import StructuredOutput
from hybridpd.errors import (
    HybridPDError,
    InvalidRequestError,
    describe,
    grpc_code,
    public_message,
)
from hybridpd.tokenizer import ChatMessage, ChatOptions
from hybridpd.v1 import generate_pb2, generate_pb2_grpc
from services.router.choices import run_request
from services.router.orchestrator import Orchestrator
from services.router.output import OutputOptions
from services.router.request_builder import ApiRequest, Sampling, new_request_id

logger = logging.getLogger(__name__)

_REASONS = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
}


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, orch: Orchestrator, served_model: str) -> None:
        self.orch = orch
        self.served_model = served_model
        self.keys = ApiKeys.from_config(orch.cfg)
        #: (tenant, the id the client knows) -> the server's ids of its requests in flight
        self.known: dict[tuple[str | None, str], set[str]] = {}

    @contextmanager
    def _known(self, tenant: str | None, visible: str, request_id: str) -> Iterator[None]:
        """While a request runs, ``Abort`` of ``visible`` by ``tenant`` finds it."""
        key = (tenant, visible)
        self.known.setdefault(key, set()).add(request_id)
        try:
            yield
        finally:
            ids = self.known[key]
            ids.discard(request_id)
            if not ids:
                del self.known[key]

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        meta = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        auth = meta.get("authorization")
        return self.keys.caller(auth if isinstance(auth, str) else None)

    def _request(
        self, msg: generate_pb2.GenerateRequest, tenant: str | None = None, request_id: str | None = None
    ) -> ApiRequest:
        """Parse ``msg`` (proto3: 0 / empty means unset) into what HTTP parses a body
        into; ``request_builder.build`` builds both alike (chat with boundaries and
        answer checkpoints). A field this server does not know (a newer client's) is
        refused by number."""
        unknown = _unknown_fields(msg)
        if unknown:
            raise InvalidRequestError("unknown fields (a newer client?): %s" % ", ".join(unknown))
        which = msg.WhichOneof("prompt")
        s = msg.sampling
        chat = ChatOptions()
        if which == "chat":
            c = msg.chat
            gen = c.add_generation_prompt if c.HasField("add_generation_prompt") else True
            if c.continue_final_message and gen:
                raise InvalidRequestError("chat: set add_generation_prompt false with continue_final_message")
            kwargs = json_format.MessageToDict(c.chat_template_kwargs) if c.HasField("chat_template_kwargs") else {}
            chat = ChatOptions(gen, c.continue_final_message, kwargs)
        skip = s.skip_special_tokens if s.HasField("skip_special_tokens") else True
        output = OutputOptions(tuple(s.stop), s.include_stop_str_in_output, s.min_tokens, skip, tuple(s.stop_token_ids))
        return ApiRequest(
            request_id or new_request_id(),
            msg.model or self.served_model,
            _sampling(s),
            text=msg.text if which == "text" else None,
            token_ids=tuple(msg.token_ids.ids) if which == "token_ids" else None,
            messages=tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages) if which == "chat" else None,
            cache_salt=msg.cache_salt or None,
            checkpoints=tuple(msg.checkpoints),
            tenant=tenant,
            chat=chat,
            add_special_tokens=which == "text",  # vLLM's completions default
            output=output,
            client_id=msg.request_id or None,
        )

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        rid = new_request_id()
        try:
            caller = self._caller(context)
            tenant = caller.tenant
            api = self._request(request, tenant, rid)
            n, visible = request.sampling.n or 1, api.client_id or api.request_id
            with self._known(tenant, visible, api.request_id):
                details = sees_cache_details(self.orch.cfg.cache_details, caller)
                async with aclosing(self._responses(api, n, visible, details)) as responses:
                    async for resp in responses:
                        yield resp
        except HybridPDError as exc:
            await context.abort(grpc_code(exc), public_message(exc, rid))
        except Exception:  # not one of ours: its text is the log's
            logger.exception("request %s failed", rid)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (request %s)" % rid)

    async def _responses(
        self, api: ApiRequest, n: int, visible: str, details: bool
    ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        """The responses of one Generate, each with the id the client knows (``visible``);
        ``promised_tokens`` (a cache detail) only with ``details``."""
        async for index, ev in run_request(self.orch, [api], n, "grpc", self.served_model):
            resp = generate_pb2.GenerateResponse(
                request_id=visible, token_ids=list(ev.token_ids), text=ev.text, index=index
            )
            for lp in ev.logprobs or ():
                top = [generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
                resp.logprobs.append(generate_pb2.TokenLogprob(logprob=lp.logprob, rank=lp.rank, top=top))
            if isinstance(ev.stop_reason, str):
                resp.stop_string = ev.stop_reason
            elif isinstance(ev.stop_reason, int):
                resp.stop_token_id = ev.stop_reason
            if ev.finished and ev.usage is not None:
                resp.finish_reason = _REASONS.get(ev.finish_reason or "", generate_pb2.FINISH_REASON_UNSPECIFIED)
                resp.usage.CopyFrom(
                    generate_pb2.Usage(
                        prompt_tokens=ev.usage.prompt_tokens,
                        cached_tokens=ev.usage.cached_tokens,
                        completion_tokens=ev.usage.completion_tokens,
                        promised_tokens=ev.usage.promised_tokens if details else None,
                    )
                )
            yield resp

    async def Abort(
        self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.AbortResponse:
        """Abort the caller's own requests that go by ``request_id`` (its key's: its tenant's)."""
        tenant = None
        try:
            tenant = self._caller(context).tenant
        except HybridPDError as exc:
            await context.abort(grpc_code(exc), describe(exc))
        ids = self.known.get((tenant, request.request_id), set())
        found = [self.orch.abort(rid) for rid in sorted(ids)]  # every one: no short cut
        return generate_pb2.AbortResponse(found=any(found))


def _sampling(s: generate_pb2.SamplingParams) -> Sampling:
    """The sampling of a request's ``SamplingParams`` message (proto3 zeros mean unset)."""
    return Sampling(
        max_tokens=s.max_tokens or None,
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        seed=s.seed if s.has_seed else None,
        ignore_eos=s.ignore_eos,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(s.logit_bias.items()),
        min_tokens=s.min_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
        bad_words=tuple(s.bad_words),
        allowed_token_ids=tuple(s.allowed_token_ids) or None,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        structured=_structured(s.structured) if s.HasField("structured") else None,
    )


def _structured(m: generate_pb2.StructuredOutput) -> StructuredOutput:
    kind = m.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("sampling.structured: set one of json_schema, json_object, regex, choice, grammar")
    ws = m.whitespace_pattern or None
    if kind == "choice":
        if not m.choice.choices:
            raise InvalidRequestError("sampling.structured.choice: needs at least one choice")
        return StructuredOutput(choice=tuple(m.choice.choices), whitespace_pattern=ws)
    if kind == "json_object":
        return StructuredOutput(json_object=m.json_object, whitespace_pattern=ws)
    field = {"json_schema": "json"}.get(kind, kind)
    return StructuredOutput(**{field: getattr(m, kind)}, whitespace_pattern=ws)


def _unknown_fields(msg: Message, path: str = "") -> list[str]:
    """Field numbers ``msg`` (and the messages it holds) carry but this proto does not define."""
    out = ["%s#%d" % (path or msg.DESCRIPTOR.name, f.field_number) for f in UnknownFieldSet(msg)]
    for fd, value in msg.ListFields():
        if fd.message_type is not None and not fd.message_type.GetOptions().map_entry:
            for i, sub in enumerate(value if fd.is_repeated else [value]):
                out += _unknown_fields(sub, "%s%s[%d]" % (path, fd.name, i) if fd.is_repeated else path + fd.name)
    return out


#: how often the health service's status follows readiness between checks (for watchers)
HEALTH_INTERVAL_S = 5.0
GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class ReadinessHealth(health.aio.HealthServicer):
    """The standard health service, SERVING only while the router is ready
    (``Orchestrator.readiness``: a live prefill and decode instance, not draining),
    for the server ("") and ``hybridpd.v1.Generation``: brought up to date on each
    ``Check`` and every ``HEALTH_INTERVAL_S`` (:func:`mark_serving`) for ``Watch``."""

    def __init__(self, orch: Orchestrator) -> None:
        super().__init__()
        self.orch = orch

    async def refresh(self) -> None:
        ready = await self.orch.readiness() is None
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GENERATION_SERVICE):
            await self.set(service, status)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()
        return await super().Check(request, context)

    async def follow(self) -> None:
        """Refresh every ``HEALTH_INTERVAL_S``, until cancelled."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                await self.refresh()
            except Exception:  # the next round tries again; a probe's Check refreshes too
                logger.exception("health status not refreshed")


def create_grpc_server(
    orch: Orchestrator,
    served_model: str,
    address: str,
    options: Sequence[tuple[str, Any]] | None = None,
    credentials: grpc.ServerCredentials | None = None,
    maximum_concurrent_rpcs: int | None = None,
) -> grpc.aio.Server:
    """The gRPC server of ``orch``, on ``address``: ``options`` (channel arguments:
    message sizes, keep-alive), ``credentials`` (TLS; None: plain text) and
    ``maximum_concurrent_rpcs`` as the caller (``server.py``) sets them."""
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=maximum_concurrent_rpcs)
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(orch, served_model), server)
    health_servicer = ReadinessHealth(orch)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        GENERATION_SERVICE,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    if credentials is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, credentials)
    server._hybridpd_health = health_servicer
    return server


async def mark_serving(server: grpc.aio.Server) -> asyncio.Task[None]:
    """Once the server listens: its health status follows readiness from now on
    (:class:`ReadinessHealth`), checked at once, then every ``HEALTH_INTERVAL_S`` by
    the task returned (the caller cancels it when the server stops)."""
    hs: ReadinessHealth = server._hybridpd_health
    await hs.refresh()
    return asyncio.create_task(hs.follow())
