"""Which prefixes a vLLM engine prefills before a prompt, so that vLLM keeps a
state at each of its extra checkpoints, and the background prefix that leaves
a P/D prompt's own tail: ``checkpoint_stages.py``'s rules with this engine's
facts (its role, whether vLLM hits inside its blocks, the EAGLE drop, the P/D
backoff). ``stages.py`` runs them; no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridpd.checkpoint_stages import staged_checkpoints, truncated_tail_stage
from hybridpd.checkpoints import checkpoint_position
from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import EngineRequest, RequestId
from hybridpd.engine.vllm.args import log_once
from hybridpd.engine.vllm.stages import PLAIN, TAIL_SUFFIX, TailStage


@dataclass(frozen=True, slots=True)
class StagePlan:
    """The staging rules of one engine (its facts: ``VllmCore``)."""

    cfg: HybridPDConfig
    role: str
    #: prompt tokens a P/D prefill does not compute (``VllmCore.prefill_backoff``)
    prefill_backoff: int
    #: whether this engine's hits drop a unit for an EAGLE-family drafter
    drop_eagle_block: bool
    #: whether vLLM hits at prefix_match_unit granularity inside its blocks
    partial_hits: bool

    def computed_prompt_tokens(self, request: EngineRequest, prefill_only: bool) -> int:
        """The prompt tokens this engine computes for ``request``: all of them, or
        on a P/D prefill all but the ``prefill_backoff`` tokens decode recomputes."""
        n = len(request.prompt_token_ids)
        return n - self.prefill_backoff if prefill_only and n > self.prefill_backoff else n

    def stages(self, request: EngineRequest, prefill_only: bool, hit: int = 0) -> tuple[tuple[int, int], ...]:
        """The ``(position, prefix length)`` prefixes prefilled before ``request`` so
        that vLLM keeps a state at each of its extra checkpoints, each past ``hit``
        (what the prompt finds cached: a prefix below it would recompute what is
        cached): ``checkpoint_stages.staged_checkpoints`` of the tokens this engine
        computes (at most ``max_extra_checkpoints`` requested ones, and the router's
        placement; the prompt's own tail on a P/D prefill, :meth:`tail_stage`, runs in
        the background after it and is not one of them). None on a decode engine,
        without prefix caching, or where vLLM cannot hit at unit granularity
        (``mamba_partial_cache_hit``: then it hits whole blocks only)."""
        if not self.cfg.enable_prefix_caching or self.role == "decode":
            return ()
        if not (request.checkpoints or request.placement):
            return ()
        if not self.partial_hits:
            log_once("vLLM hits whole blocks only here (no partial hash hits): extra checkpoints are not staged")
            return ()
        staged = staged_checkpoints(
            request.checkpoints,
            self.computed_prompt_tokens(request, prefill_only),
            self.cfg.prefix_match_unit,
            self.drop_eagle_block,
            self.cfg.max_extra_checkpoints,
            placed=request.placement,
        )
        return tuple((p, n) for p, n in staged if p > hit)

    def tail_stage(self, request: EngineRequest, prefill_only: bool) -> TailStage | None:
        """The background prefix that leaves ``request``'s own tail where its P/D
        truncation drops it a unit (``checkpoint_stages.truncated_tail_stage``): after the
        prompt it hits the truncated tail and computes ``u + 1`` tokens (an answer
        prefill's terms: only while no foreground request is live, aborted for one
        that arrives). None off a P/D prefill, where vLLM hits whole blocks only, or
        with ``vllm_tail_stage`` off."""
        cfg = self.cfg
        n, computed = len(request.prompt_token_ids), self.computed_prompt_tokens(request, prefill_only)
        if computed == n or not cfg.enable_prefix_caching or not self.partial_hits or not cfg.vllm_tail_stage:
            return None
        found = truncated_tail_stage(n, computed, cfg.prefix_match_unit, self.drop_eagle_block)
        if found is None:
            return None
        position, length = found
        prefix = replace(
            request,
            request_id=RequestId(request.request_id + TAIL_SUFFIX),
            prompt_token_ids=request.prompt_token_ids[:length],
            sampling=PLAIN,
            checkpoints=(),
            placement=(),
            background=True,
        )
        return TailStage(position, prefix)

    def tail_checkpoint(self, request: EngineRequest, prefill_only: bool) -> int:
        """vLLM caches the state (and a partial attention entry) at the last unit
        boundary its prompt allows: ``(N' - 1) // u * u`` of the N' tokens it computes
        (:meth:`computed_prompt_tokens`: N - 1 on a P/D prefill), whatever the hit
        (vLLM 0.32 ``FullAttentionManager._cache_partial_tail_block`` and the Mamba
        manager's tail)."""
        if not self.cfg.enable_prefix_caching:
            return 0
        computed = self.computed_prompt_tokens(request, prefill_only)
        return checkpoint_position(computed, self.cfg.prefix_match_unit, False)
