"""Typed messages between router, prefill and decode (carried by Ray)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.engine.base import BufferMeta, EngineRequest
from hybridpd.transfer.nixl_handoff import HandoffDescriptor


@dataclass(frozen=True, slots=True)
class PrefillCommand:
    request: EngineRequest
    #: longest usable hit in MooncakeStore per the index (0: none or unknown)
    store_hit: int = 0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """The first token and, unless the request already finished, the handoff."""

    request_id: str
    instance: str
    first_token_id: int | None  # None: decode produces the first token (vLLM's P/D)
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    loaded_from_store: int
    descriptor: HandoffDescriptor | None = None
    kv_meta: BufferMeta | None = None
    state_meta: BufferMeta | None = None
    draft_meta: BufferMeta | None = None
    #: vLLM engines: the NixlConnector's kv_transfer_params (vLLM moves the KV itself)
    transfer_params: dict | None = None

    @property
    def has_handoff(self) -> bool:
        return self.descriptor is not None or self.transfer_params is not None


@dataclass(frozen=True, slots=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
