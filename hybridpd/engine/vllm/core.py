"""The vLLM a ``VllmEngine`` drives: ``VllmCore``, its base.

It starts vLLM's ``LLMEngine`` with its engine core in this process
(``enable_multiprocessing=False``), with the variables vLLM reads set for the
build only (``environment.py``), our engine arguments (``args.py``) and vLLM's
defaults patched (``patches.py``), then reads back what vLLM made of them: its KV-cache
groups, its hit rules, whether it checkpoints junctions itself, and what its
caches hold for a prompt (its own lookups, no side effects). It hands requests
to vLLM; what they are and when is ``engine.py``'s. vLLM itself, and every
internal read here, is reached through ``adapter.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import EngineRequest, PoolStats, SpecStats
from hybridpd.engine.vllm import adapter, environment
from hybridpd.engine.vllm.args import (
    SHARED_PREFIX_OPTION,
    Role,
    check_dtype,
    engine_kwargs,
    log_once,
    mooncake_config,
)
from hybridpd.engine.vllm.kv_events import GroupSpec, KVEventFeed, kv_events_endpoint
from hybridpd.engine.vllm.patches import (
    kept_cpu_affinity,
    nixl_without_progress_thread,
    one_gloo_device,
    store_puts_to_own_segment,
)
from hybridpd.engine.vllm.sampling import vllm_sampling
from hybridpd.engine.vllm.sequencer import Ledger, Tag
from hybridpd.errors import InvalidRequestError
from hybridpd.hashing import BlockHash, BlockHasher
from hybridpd.model_identity import engine_identity

logger = logging.getLogger(__name__)


class VllmCore:
    """One started vLLM engine in ``role`` (local, prefill or decode), and what it says of itself."""

    def __init__(
        self,
        cfg: HybridPDConfig,
        model_dir: Path,
        role: Role = "local",
        *,
        instance: str = "local",
        cache_events: bool = False,
        store: tuple[str, str] | None = None,
    ) -> None:
        """``cache_events``: vLLM publishes its KV-cache events (ZMQ, a machine-local
        socket) and ``feed`` translates them; ``store``: (Mooncake master, metadata URL)
        for a prefill engine's shared prefix store (MooncakeStoreConnector beside the
        NixlConnector). ``instance`` names the worker in logs. vLLM's KV and state space
        is ``cfg.vllm_kv_cache_memory_bytes``, or ``cfg.vllm_kv_cache_blocks`` pages
        whatever the bytes say. The variables vLLM reads are set for the build only
        (``environment.build_environment``)."""
        adapter.check_installed()  # its internals are read below (adapter.py)
        check_dtype(cfg, model_dir)
        events_endpoint = kv_events_endpoint() if cache_events else None
        with_store = store is not None and role == "prefill"
        self.cfg = cfg
        self.role = role
        self.model_dir = model_dir
        kw = engine_kwargs(cfg, model_dir, role, kv_events_endpoint=events_endpoint, store=with_store)
        logger.info("%s: starting vLLM (%s) with %s", instance, role, kw)
        if role != "local":
            nixl_without_progress_thread()
        build = environment.build_environment(
            cfg.vllm_kv_cache_memory_bytes,
            side_channel=role != "local",
            mooncake=mooncake_config(*store) if store is not None and with_store else None,
        )
        #: what this engine and its scheduler (vLLM's, subclassed: ``sequencer.py``) tell each other
        self.ledger = Ledger()
        with build, one_gloo_device(), kept_cpu_affinity():
            # vLLM's own scheduling (async: one step scheduled while the last runs), subclassed
            scheduler = {"scheduler_cls": adapter.scheduler_class(self.ledger), "async_scheduling": True}
            self.engine = adapter.llm_engine({**kw, **scheduler})
        logger.info(
            "%s: vLLM schedules through hybridpd's AsyncScheduler subclass (checkpoint prefixes, background"
            " work: engine/vllm/sequencer.py); vLLM's warning about a custom scheduler class refers to it",
            instance,
        )
        try:  # what vLLM made of our arguments; a refusal stops the engine it built
            if events_endpoint is not None:
                environment.check_event_hashes()
            #: vLLM's ``EngineCore``, in this process
            self.core = adapter.in_process_core(self.engine)
            #: its KV-cache groups, in vLLM's order (its events' group index)
            self.groups = adapter.kv_cache_groups(self.core)
            rules = adapter.scheduler_rules(self.core)
        except Exception:
            with contextlib.suppress(Exception):  # the refusal is what is reported
                adapter.shutdown(self.engine)
            raise
        #: whether vLLM checkpoints junctions at their exact position (its scheduler's
        #: narrowed ``enable_mamba_shared_prefix_checkpoint``)
        self.shared_prefix_checkpoint = rules.shared_prefix_checkpoint
        self._check_shared_prefix_option(bool(kw.get(SHARED_PREFIX_OPTION)), rules)
        #: the store segment this engine's store puts go to (``patches.store_puts_to_own_segment``)
        self.store_segment = store_puts_to_own_segment() if with_store else None
        self.model_id = engine_identity(cfg, model_dir)  # the weights' digest, vLLM's version, ...
        self.unit = cfg.prefix_match_unit
        self.hasher = BlockHasher(unit=self.unit, algo=cfg.hash_algo, seed=cfg.hash_seed)
        self.spec = SpecStats()  # vLLM reports speculative decoding in its own metrics
        #: vLLM's KV events, translated (None: not asked for)
        self.feed: KVEventFeed | None = None
        if events_endpoint is not None:
            self.feed = KVEventFeed(self.hasher, self._groups())
            self.feed.start(events_endpoint)
        #: prompt tokens a P/D prefill does not compute (vLLM's NixlConnector truncates them:
        #: decode recomputes them on top of the pulled KV and state); its tail is where N - this is
        self.prefill_backoff = self._prefill_backoff() if role == "prefill" else 0
        #: whether this engine's hits drop a unit for an EAGLE-family drafter (vLLM's scheduler says)
        self.drop_eagle_block = rules.eagle_block_drop
        #: whether vLLM hits at prefix_match_unit granularity inside its blocks (else extras are not staged)
        self.partial_hits = rules.partial_hits

    # -- what vLLM made of our arguments ---------------------------------------------------
    def _check_shared_prefix_option(self, asked: bool, rules: adapter.SchedulerRules) -> None:
        """Say so where vLLM turned ``enable_mamba_shared_prefix_checkpoint`` off: it
        does when the prefix match unit is not below its scheduler block or under
        multi-module MTP (``args.shared_prefix_checkpoint``)."""
        if asked and not rules.shared_prefix_checkpoint:
            log_once(
                "vLLM junction checkpoints (%s) asked for but turned off by vLLM for a %s engine: it needs"
                " prefix_match_unit (%d) below its scheduler block (%s tokens, partial hits %s) and no"
                " multi-module MTP",
                SHARED_PREFIX_OPTION,
                self.role,
                self.cfg.prefix_match_unit,
                rules.block_size,
                rules.partial_hits,
            )

    def _groups(self) -> dict[int, GroupSpec]:
        """The engine's KV-cache groups, as its KV events name them (kind, block size)."""
        return {i: GroupSpec(g.kind, g.block_size) for i, g in enumerate(self.groups)}

    def _prefill_backoff(self) -> int:
        """vLLM 0.32's ``NixlConnectorScheduler._prefill_backoff``: one token for a
        model with Mamba groups, more for multi-module MTP's lookahead."""
        kinds = {g.kind for g in self.groups}
        return max(1 if "mamba" in kinds else 0, adapter.prefill_lookahead_tokens(self.core) - 1)

    # -- handing requests to vLLM ------------------------------------------------------------
    def _add_to_vllm(
        self, req: EngineRequest, max_tokens: int, transfer: dict[str, Any] | None, full: bool, tag: Tag | None
    ) -> str:
        """Hand ``req`` to vLLM (``full``: with every sampling field, else plain:
        ``sampling.py``), ``tag``ged for our scheduler; returns vLLM's id of it.
        vLLM's refusal is ours (InvalidRequestError)."""
        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        try:
            extra = tag.extra_args() if tag is not None else None
            sampling = vllm_sampling(req.sampling, max_tokens, transfer, full=full, tag=extra)
            return str(self.engine.add_request(req.request_id, prompt, sampling))
        except adapter.client_error() as e:
            raise InvalidRequestError(str(e)) from e

    def _check_sampling(self, request: EngineRequest) -> None:
        """Refuse on a P/D prefill what decode would refuse of ``request``'s sampling
        (vLLM's own checks: ranges, token ids, the grammar's syntax), before any prompt
        token is computed (and on a local engine before its checkpoint prefixes); the
        prefill itself samples plainly. A prefill cannot check what only decode's
        configuration refuses (vLLM refuses ``logit_bias`` with speculative decoding)."""
        sp = request.sampling
        if not (sp.processes_logits or sp.structured is not None or sp.logprobs is not None):
            return
        try:
            full = vllm_sampling(sp, sp.max_tokens, None, full=True)
            # decode's speculative config is not known on a prefill engine
            adapter.verify_sampling(self.engine, full, speculative=self.role != "prefill")
        except adapter.client_error() as e:
            raise InvalidRequestError(str(e)) from e

    # -- what its caches hold ----------------------------------------------------------------
    def local_hit(
        self, token_ids: Sequence[int], cache_salt: str | None = None, hashes: Sequence[BlockHash] = ()
    ) -> int:
        """What vLLM's local prefix cache would restore for ``token_ids`` now: its own
        admission lookup (``KVCacheManager.get_computed_blocks``, which reads the
        block pool's hash table only) on a request hashed by its engine core; 0
        without prefix caching. The worker asks before an answer prefill."""
        if not self.cfg.enable_prefix_caching or len(token_ids) < 2:
            return 0
        return adapter.computed_tokens(self.core, self._probe(self.core, token_ids, cache_salt))

    def store_hit(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """What vLLM's MooncakeStoreConnector would load for ``token_ids`` now: its
        scheduler's own store lookup (``LookupKeyClient.lookup``, a read of the
        store's keys) on a probe request; 0 without a store connector or when the
        lookup fails (then staging may recompute what the store holds, never more)."""
        if not self.cfg.enable_prefix_caching or len(token_ids) < 2:
            return 0
        store = adapter.store_scheduler(self.core)
        if store is None or not adapter.store_lookup_enabled(store):
            return 0
        probe = self._probe(self.core, token_ids, cache_salt)
        try:
            return adapter.store_hit_tokens(store, probe)
        except Exception:  # the store is a cache: staging then treats it as empty
            logger.warning("MooncakeStore lookup failed: staging ignores the store", exc_info=True)
            return 0

    def cached_hit(self, request: EngineRequest) -> int:
        """Where ``request`` would start computing now: the longer of vLLM's local
        prefix-cache hit and its MooncakeStore hit. Staging stays past it, so a
        prefix never recomputes (and never reports as the prompt's hit) a state the
        store would load whole; a router placement from an index that did not yet
        show the store's entries is dropped here."""
        hit = self.local_hit(request.prompt_token_ids, request.cache_salt)
        return max(hit, self.store_hit(request.prompt_token_ids, request.cache_salt))

    @staticmethod
    def _probe(core: Any, token_ids: Sequence[int], cache_salt: str | None) -> Any:
        """A request vLLM never runs, hashed by ``core``'s block hasher, for lookups."""
        return adapter.probe_request(core, token_ids, cache_salt)

    def _core(self) -> Any:
        """vLLM's ``EngineCore`` (``adapter.in_process_core``)."""
        return self.core

    def _pool_stats(self, running: int) -> PoolStats:
        """The block pool's accounting, with ``running`` requests."""
        pool = adapter.block_pool_counts(self.core)
        # prefix-cache entries, (hash, group) keys: O(1); a page holding a partial entry besides
        # its full one counts twice (counting pages would walk the pool on every load report)
        return PoolStats(pool.total, pool.free, pool.cached, 0, 0, running, 0, self._page_bytes())

    def _page_bytes(self) -> int:
        """One page of vLLM's block pool (every group's block is padded to it)."""
        return max((g.page_bytes for g in self.groups), default=0)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
        try:
            adapter.shutdown(self.engine)
        except Exception:  # already down
            logger.debug("vLLM shutdown failed", exc_info=True)
