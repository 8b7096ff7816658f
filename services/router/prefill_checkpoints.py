"""Where a routed prefill leaves its checkpoints: the junction the index
lookup found, the chat message boundaries, and the positions
``checkpoint_placement`` places for a request that will diverge first
(``hybridpd/placement.py``), in the engine's checkpoint geometry.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from hybridpd.checkpoints import merge_requested, requested_checkpoints
from hybridpd.config import HybridPDConfig
from hybridpd.divergence import DivergenceHistory
from hybridpd.engine.base import EngineRequest
from hybridpd.engine.profile import EngineProfile
from hybridpd.placement import PlacementAsk, place, worth_a_step
from services.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)


class PrefillCheckpoints:
    """The extra checkpoints of one router's prefills. ``divergence`` (how far routed
    prompts shared a prefix: the placement's prior) is the caller's, shared."""

    def __init__(
        self, cfg: HybridPDConfig, profile: EngineProfile, divergence: DivergenceHistory, metrics: RouterMetrics
    ) -> None:
        self.cfg = cfg
        self.profile = profile
        self.divergence = divergence
        self.metrics = metrics

    def for_prefill(
        self, req: EngineRequest, hit: int, known: int, looked_up: bool, boundaries: tuple[int, ...] = ()
    ) -> EngineRequest:
        """``req`` as its prefill runs it: under the branch-aware policy, with the
        junction the lookup found (``known``: where the prompt leaves every cached prefix)
        among its checkpoint positions when it lies past the hit, so the second
        request to share a prefix leaves a checkpoint there for every later one
        (the engine rounds it down to a position it can write:
        ``checkpoints.requested_checkpoints``); and with the checkpoints
        ``checkpoint_placement`` places along it for a request that will
        diverge from it first (:meth:`_placement`). Where each is a staged
        prefix (vLLM: an engine step for this request), the junction and the
        chat message ``boundaries`` (``Built.boundaries``) are staged only
        ``vllm_stage_gap_tokens`` past the hit or the one kept before them
        (``placement.worth_a_step``): a turn that adds a few dozen tokens to a
        cached conversation stages none."""
        n, cfg = len(req.prompt_token_ids), self.cfg
        if looked_up:
            self.divergence.observe(n, known, cfg.prefix_match_unit)
        extra = boundaries
        if cfg.checkpoint_policy == "branch-aware" and known > hit:
            extra = (*extra, known)
        if self.profile.staged:
            extra = worth_a_step(extra, hit, cfg.vllm_stage_gap_tokens)
        if extra:
            merged = merge_requested(req.checkpoints, tuple(sorted(set(extra))), n)
            req = req if merged == req.checkpoints else replace(req, checkpoints=merged)
        placed = self._placement(req, hit, known)
        return replace(req, placement=placed) if placed else req

    def _placement(self, req: EngineRequest, hit: int, known: int = 0) -> tuple[int, ...]:
        """``placement.place`` for ``req``'s prefill from ``hit`` (the lookup's), in
        the engine's checkpoint geometry. The native engine writes them mid-chunk
        (snapshots) under its slot rules; the vLLM engine stages each as a prefix
        prefill (``engine/vllm/stages.py``: an engine step and a token each), so
        there any unit multiple past the hit is a candidate (unless
        ``vllm_placement`` is off); there a prompt is placed only where one later
        sharer is expected (it shares ``known`` tokens itself, or most prompts do:
        ``DivergenceHistory.followers``), and each checkpoint must also be
        expected to save ``vllm_stage_tokens`` of prefill, its step."""
        cfg, profile = self.cfg, self.profile
        if not cfg.enable_prefix_caching or cfg.checkpoint_placement == "off":
            return ()
        if profile.staged and not cfg.vllm_placement:
            return ()
        n, drop = len(req.prompt_token_ids), profile.eagle_drop_prefill
        u, b, a = profile.geometry.unit, profile.geometry.block, profile.geometry.alignment
        requested = requested_checkpoints(req.checkpoints, hit, n, u, b, a, drop, cfg.max_extra_checkpoints)
        try:  # NOTE: on the event loop: O(1) candidates, a DP over at most 192 of them (ms)
            placed = place(
                PlacementAsk(
                    policy=cfg.checkpoint_placement,
                    num_tokens=n,
                    hit=hit,
                    fixed=tuple(requested),
                    count=cfg.placement_checkpoints,
                    unit=u,
                    mamba_block_size=b,
                    alignment=a,
                    drop_eagle_block=drop,
                    history=self.divergence,
                    interval=cfg.placement_interval,
                    min_gain=cfg.placement_min_gain,
                    step_tokens=cfg.vllm_stage_tokens if profile.staged else 0,
                    known=known,
                    staged=profile.staged,
                )
            )
        except Exception:  # placement is an optimisation: never fail a request for it
            logger.exception("checkpoint placement failed for a %d-token prompt; placing none", n)
            return ()
        self.metrics.placed_checkpoints.inc(len(placed))
        return placed
