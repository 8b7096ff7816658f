"""Typed messages between router, prefill and decode (carried by Ray)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.engine.base import EngineRequest, HandoffTicket, TokenLogprobs


@dataclass(frozen=True, slots=True)
class PrefillCommand:
    request: EngineRequest
    #: longest usable hit in MooncakeStore per the index (0: none or unknown)
    store_hit: int = 0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """The tokens sampled at prefill and, unless the request already finished, the handoff."""

    request_id: str
    instance: str
    #: output tokens the prefill produced: the first one (native engine) or none
    #: (vLLM, whose decode samples every output token); the router streams them first
    token_ids: tuple[int, ...]
    #: set when the request finished at prefill (then there is no ticket)
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    loaded_from_store: int
    #: opaque: only the decode engine of the same kind reads it
    ticket: HandoffTicket | None = None
    #: where the prefill left this prompt's tail state checkpoint, as its engine reported it
    #: (``RequestOutput.checkpoints``; 0: none; None: not reported, the router predicts it
    #: by the native rule)
    tail_checkpoint: int | None = None
    #: the other checkpoints it left (junctions, boundaries, client and placed positions), ascending
    extra_checkpoints: tuple[int, ...] = ()
    #: the prefill's own time on its actor, seconds (its queue included): the router's TTFT stages
    prefill_seconds: float = 0.0
    #: per token of ``token_ids``, when the request asked for logprobs
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def has_handoff(self) -> bool:
        return self.ticket is not None


@dataclass(frozen=True, slots=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    #: per token of ``token_ids``, when the request asked for logprobs
    logprobs: tuple[TokenLogprobs, ...] | None = None
