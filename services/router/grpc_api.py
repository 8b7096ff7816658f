"""gRPC ``hybridpd.v1.Generation`` (Generate, Abort) plus the standard health
service and reflection. Errors become status codes via
``hybridpd.errors.grpc_code``; a cancelled stream aborts the request."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hybridpd.auth import ApiKeys
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.errors import HybridPDError, InvalidRequestError, describe, grpc_code
from hybridpd.tokenizer import ChatMessage
from hybridpd.v1 import generate_pb2, generate_pb2_grpc
from services.router.orchestrator import Orchestrator

_REASONS = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
}


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, orch: Orchestrator, served_model: str) -> None:
        self.orch = orch
        self.served_model = served_model
        self.keys = ApiKeys(orch.cfg.api_keys)

    def _tenant(self, context: grpc.aio.ServicerContext) -> str | None:
        meta = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        auth = meta.get("authorization")
        return self.keys.tenant(auth if isinstance(auth, str) else None)

    def _request(self, msg: generate_pb2.GenerateRequest, tenant: str | None = None) -> EngineRequest:
        if msg.model and msg.model != self.served_model:
            raise InvalidRequestError("model %r is not served here (serving %r)" % (msg.model, self.served_model))
        which = msg.WhichOneof("prompt")
        tok = self.orch.tokenizer
        if which == "text":
            tokens = tok.encode(msg.text)
        elif which == "token_ids":
            tokens = list(msg.token_ids.ids)
        elif which == "chat":
            if not msg.chat.messages:
                raise InvalidRequestError("chat needs at least one message")
            tokens = tok.apply_chat_template([ChatMessage(m.role, m.content) for m in msg.chat.messages])
        else:
            raise InvalidRequestError("one of text, token_ids or chat is required")
        s = msg.sampling  # ranges: checked on admission (hybridpd/validation.py), as for HTTP
        sp = SamplingParams(
            max_tokens=s.max_tokens or 16,
            temperature=s.temperature,
            top_p=s.top_p or 1.0,
            top_k=s.top_k,
            seed=s.seed if s.has_seed else None,
            stop_token_ids=() if s.ignore_eos else tok.stop_token_ids,  # the tokenizer's end-of-turn ids are EOS too
            ignore_eos=s.ignore_eos,
        )
        if len(msg.cache_salt) > 256:
            raise InvalidRequestError("cache_salt longer than 256 characters")
        rid = msg.request_id or uuid.uuid4().hex
        if len(rid) > 128:
            raise InvalidRequestError("request_id longer than 128 characters")
        salt = ApiKeys.salt(tenant, msg.cache_salt or None)
        return EngineRequest(RequestId(rid), tuple(tokens), sp, salt, tuple(msg.checkpoints))

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            req = self._request(request, self._tenant(context))
            stop = tuple(request.sampling.stop)
            async for ev in self.orch.stream(req, "grpc", None, stop):
                resp = generate_pb2.GenerateResponse(
                    request_id=req.request_id, token_ids=list(ev.token_ids), text=ev.text
                )
                if ev.finished and ev.usage is not None:
                    resp.finish_reason = _REASONS.get(ev.finish_reason or "", generate_pb2.FINISH_REASON_UNSPECIFIED)
                    resp.usage.CopyFrom(
                        generate_pb2.Usage(
                            prompt_tokens=ev.usage.prompt_tokens,
                            cached_tokens=ev.usage.cached_tokens,
                            completion_tokens=ev.usage.completion_tokens,
                            promised_tokens=ev.usage.promised_tokens,
                        )
                    )
                yield resp
        except HybridPDError as exc:
            await context.abort(grpc_code(exc), describe(exc))

    async def Abort(
        self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.AbortResponse:
        try:
            self._tenant(context)
        except HybridPDError as exc:
            await context.abort(grpc_code(exc), describe(exc))
        return generate_pb2.AbortResponse(found=self.orch.abort(request.request_id))


def create_grpc_server(orch: Orchestrator, served_model: str, address: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(orch, served_model), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    server.add_insecure_port(address)
    server._hybridpd_health = health_servicer
    return server


async def mark_serving(server: grpc.aio.Server) -> None:
    hs = server._hybridpd_health
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    await hs.set("hybridpd.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
