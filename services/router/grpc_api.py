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
from hybridpd.errors import HybridPDError, describe, grpc_code
from hybridpd.tokenizer import ChatMessage
from hybridpd.v1 import generate_pb2, generate_pb2_grpc
from services.router.orchestrator import Orchestrator
from services.router.request_builder import ApiRequest, Built, Sampling, build

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

    def _request(self, msg: generate_pb2.GenerateRequest, tenant: str | None = None) -> Built:
        """Parse ``msg`` (proto3: 0 / empty means unset) and build it as HTTP does
        (``request_builder.build``: chat with boundaries and answer checkpoints)."""
        which = msg.WhichOneof("prompt")
        s = msg.sampling
        api = ApiRequest(
            msg.request_id or uuid.uuid4().hex,
            msg.model or self.served_model,
            Sampling(
                max_tokens=s.max_tokens or None,
                temperature=s.temperature,
                top_p=s.top_p or 1.0,
                top_k=s.top_k,
                seed=s.seed if s.has_seed else None,
                ignore_eos=s.ignore_eos,
            ),
            text=msg.text if which == "text" else None,
            token_ids=tuple(msg.token_ids.ids) if which == "token_ids" else None,
            messages=tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages) if which == "chat" else None,
            cache_salt=msg.cache_salt or None,
            checkpoints=tuple(msg.checkpoints),
            tenant=tenant,
        )
        return build(api, self.orch, self.served_model)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            built = self._request(request, self._tenant(context))
            req, stop = built.request, tuple(request.sampling.stop)
            async for ev in self.orch.stream(req, "grpc", None, stop, built.answer, built.boundaries):
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
