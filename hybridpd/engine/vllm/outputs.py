"""vLLM's request outputs as ours (``RequestOutput``), and the handoff ticket a
P/D prefill's output carries (``VllmTicket``).

Prefill/decode disaggregation uses vLLM's NixlConnector, so the ticket carries
no buffers of ours but vLLM's ``kv_transfer_params``. For hybrid models vLLM's
prefill side stops one token short (decode recomputes the last prompt token on
top of the pulled KV and recurrent state), so the token a P/D prefill samples is
NOT the first output token and is never reported: its output carries no
tokens, and decode produces every output token, the first included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridpd.engine.base import (
    EngineRequest,
    FinishReason,
    HandoffTicket,
    RequestOutput,
    TokenLogprobs,
)
from hybridpd.engine.vllm.sampling import token_logprobs

#: vLLM's finish reasons as ours: "error" (a grammar that did not compile, a failed KV load
#: under the fail policy) is an engine failure (the router fails the request); "repetition"
#: (not asked for) is a stop
FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
}


@dataclass(frozen=True, slots=True)
class VllmTicket(HandoffTicket):
    """What decode needs to continue a request prefilled by another vLLM engine:
    the NixlConnector's ``kv_transfer_params`` (vLLM's decode pulls KV and state
    itself; it produces every output token, the first included)."""

    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)


def output(
    req: EngineRequest,
    tokens: tuple[int, ...],
    finished: bool,
    reason: FinishReason | None,
    cached: int,
    logprobs: tuple[TokenLogprobs, ...] | None = None,
) -> RequestOutput:
    return RequestOutput(req.request_id, tokens, finished, reason, len(req.prompt_token_ids), cached, logprobs)


def translate(
    out: Any, request: EngineRequest, prefill_only: bool, sampled: bool, cached: int
) -> tuple[RequestOutput, VllmTicket | None]:
    """One of vLLM's outputs for ``request`` (``cached``: the hit to report) as ours.
    ``sampled``: vLLM ran the request with its full sampling (not a P/D prefill or
    a background try), so vLLM's logprobs are reported. A finished P/D prefill
    reports no token; with ``kv_transfer_params`` it was handed off: finished here,
    not for the client (no finish reason), and the ticket comes with it."""
    comp = out.outputs[0]
    tokens = tuple(comp.token_ids)
    reason = FINISH_REASONS.get(str(comp.finish_reason), FinishReason.STOP) if out.finished else None
    logprobs = None
    k = request.sampling.logprobs
    if k is not None and comp.logprobs is not None and sampled:
        logprobs = token_logprobs(tokens, comp.logprobs, k)  # vLLM's, of a request sampled in full
    ticket = None
    if prefill_only and out.finished:
        params = out.kv_transfer_params or {}
        if params:  # handed off: finished here, not for the client
            ticket = VllmTicket(request.request_id, 0, None, cached, params)
            reason = None
        tokens = ()  # not an output token (see the module docstring)
    return output(request, tokens, out.finished, reason, cached, logprobs), ticket
