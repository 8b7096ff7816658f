# Over 350 lines: one adapter class: the whole engine protocol over vLLM's LLMEngine.
"""vLLM behind the engine protocol: ``VllmEngine``.

Drives vLLM's ``LLMEngine`` with its engine core in this process
(``enable_multiprocessing=False``), one ``step()`` at a time, exactly like the
native engine: the actors' engine loop owns it. (vLLM's ``AsyncLLM`` wraps the
same engine core for asyncio servers; our actors step engines from a thread.)

Prefill/decode disaggregation uses vLLM's NixlConnector, so the handoff
ticket (``VllmTicket``) carries no buffers of ours but vLLM's ``kv_transfer_params``:

* prefill: ``add_request(req, prefill_only=True)`` runs the prompt with
  ``max_tokens=1`` and ``do_remote_decode``; the finished output carries the
  ``kv_transfer_params`` decode needs. For hybrid models vLLM's prefill side
  stops one token short (decode recomputes the last prompt token on top of
  the pulled KV and recurrent state), so the token it samples is NOT the first
  output token and is never reported: the prefill output carries no tokens;
* decode: ``add_handoff(request, VllmTicket)`` submits the request with those params;
  vLLM's connector pulls KV and state from the prefill engine over NIXL and
  decode produces every output token, the first included.

So decode owns all sampling: penalties, logit bias, bad words, ``min_tokens``,
grammars and logprobs go to vLLM on decode (and on a local engine) only; the
prefill, checkpoint prefixes and background requests sample one plain greedy
token no one reads (``sampling.py``).

Token ids in, token ids out: the router tokenizes (the tokenizer files are in
the model directory, so both sides tokenize identically).

``EngineRequest.checkpoints`` (junctions, chat boundaries, client positions)
and ``EngineRequest.placement`` (the router's placed positions)
become checkpoints by prefilling the prompt's prefixes first, each ending where
vLLM's tail rule keeps a state (``stages.py``; positions by
``checkpoint_stages.staged_checkpoints``) on local and prefill engines. vLLM also
finds junctions itself, in its local cache (``args.shared_prefix_checkpoint``;
``VllmEngine.shared_prefix_checkpoint`` says whether its exact-junction option
is in effect); docs/DESIGN.md section 4, "Checkpoints on the vLLM engine".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridpd.checkpoint_stages import staged_checkpoints, truncated_tail_stage
from hybridpd.checkpoint_value import LINEAR_ONLY
from hybridpd.checkpoints import checkpoint_position
from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import (
    CacheEvent,
    EngineRequest,
    FinishReason,
    HandoffStats,
    HandoffTicket,
    KVExport,
    PoolStats,
    RequestId,
    RequestOutput,
    SpecStats,
    StateCheckpoint,
    TokenLogprobs,
)
from hybridpd.engine.vllm.args import SHARED_PREFIX_OPTION, Role, check_dtype, engine_kwargs, log_once, mooncake_config
from hybridpd.engine.vllm.background import BackgroundQueue
from hybridpd.engine.vllm.internals import check_version, require
from hybridpd.engine.vllm.kv_events import GroupSpec, KVEventFeed, kv_events_endpoint
from hybridpd.engine.vllm.patches import (
    kept_cpu_affinity,
    nixl_without_progress_thread,
    one_gloo_device,
    store_puts_to_own_segment,
)
from hybridpd.engine.vllm.sampling import token_logprobs, vllm_sampling
from hybridpd.engine.vllm.stages import PLAIN, TAIL_QUEUE_LIMIT, TAIL_SUFFIX, Stages, TailStage
from hybridpd.errors import ConfigError, InvalidRequestError
from hybridpd.hashing import BlockHasher
from hybridpd.model_identity import engine_identity
from hybridpd.procs import listen_ports

logger = logging.getLogger(__name__)

#: vLLM's KV and state space per engine unless the caller names one
DEFAULT_KV_CACHE_BYTES = 1 << 30
#: the environment variable that overrides it for engines built by the workers (not a config
#: field: tests and benchmarks shrink the space so that prompts evict each other)
KV_CACHE_BYTES_ENV = "HYBRIDPD_VLLM_KV_CACHE_MEMORY_BYTES"
#: the same in pages (vLLM's ``num_gpu_blocks_override``): a page's bytes depend on the CPU
#: (vLLM 0.32's pages of the tiny Qwen3-Next: 640 tokens, 320 KiB on an AMD EPYC with
#: AVX512-BF16; 384 tokens, 192 KiB on one without), a page count does not
KV_CACHE_BLOCKS_ENV = "HYBRIDPD_VLLM_KV_CACHE_BLOCKS"
#: a background try (a P/D prompt's tail stage, an answer prefill) waits while a handed-off
#: prefill's KV awaits decode's NIXL read, at most this long after the handoff: NIXL progresses
#: only when this engine steps (``patches.nixl_without_progress_thread``), so a background step
#: (a whole prefill chunk) would hold decode's read, and the first token, until it ended
SEND_HOLD_S = 1.0
#: how often an engine with nothing to compute polls its connector: within ``SEND_HOLD_S`` of a
#: handoff (decode's read waits on it), and later (an unread handoff waits for vLLM's timeout)
SEND_POLL_S, IDLE_POLL_S = 0.001, 0.005
#: vLLM's finish reasons as ours: "error" (a grammar that did not compile, a failed KV load
#: under the fail policy) is an engine failure (the router fails the request); "repetition"
#: (not asked for) is a stop
_FINISH_REASONS = {
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


@dataclass(slots=True)
class _Live:
    request: EngineRequest
    prefill_only: bool
    handoff: VllmTicket | None = None


class VllmEngine:
    """One vLLM engine in ``role`` (local, prefill or decode)."""

    #: vLLM loads prefixes through its own connectors; its KV events feed the index
    imports_checkpoints = False
    #: our store holds nothing of vLLM's (its connector writes it): positions alone value it
    compute_model = LINEAR_ONLY

    def __init__(
        self,
        cfg: HybridPDConfig,
        model_dir: Path,
        role: Role = "local",
        *,
        instance: str = "local",
        cache_events: bool = False,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_blocks: int | None = None,
        store: tuple[str, str] | None = None,
    ) -> None:
        """``cache_events``: vLLM publishes its KV-cache events (ZMQ, a machine-local
        socket) and ``pop_cache_events`` returns them translated; ``store``: (Mooncake
        master, metadata URL) for a prefill engine's shared prefix store
        (MooncakeStoreConnector beside the NixlConnector). ``instance`` names the
        worker in logs. ``kv_cache_memory_bytes``: vLLM's KV and state space (None:
        ``$HYBRIDPD_VLLM_KV_CACHE_MEMORY_BYTES``, else 1 GiB); ``kv_cache_blocks``: that space
        in pages (None: ``$HYBRIDPD_VLLM_KV_CACHE_BLOCKS``, else by bytes); vLLM then
        allocates exactly that many pages, whatever the bytes say."""
        import vllm

        check_version(vllm.__version__)  # its internals are read below (internals.py)
        check_dtype(cfg, model_dir)
        events_endpoint = kv_events_endpoint() if cache_events else None
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = int(os.environ.get(KV_CACHE_BYTES_ENV) or DEFAULT_KV_CACHE_BYTES)
        if cfg.device == "cpu":
            if kv_cache_memory_bytes % (1 << 30):
                # vLLM's CPU platform replaces kv_cache_memory_bytes by VLLM_CPU_KVCACHE_SPACE (whole
                # GiB) whenever that is set: a space below or between GiB needs it unset
                os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
            else:
                os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_memory_bytes >> 30))
        if events_endpoint is not None:
            os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"  # full hashes: they equal our chain
        #: the folder of MooncakeStoreConnector's config file (removed by ``close``)
        self._tmpdir: str | None = None
        if store is not None and role == "prefill":
            self._tmpdir = tempfile.mkdtemp(prefix="hybridpd-mooncake-")
            path = Path(self._tmpdir) / "mooncake.json"
            path.write_text(json.dumps(mooncake_config(*store)))
            os.environ["MOONCAKE_CONFIG_PATH"] = str(path)
        if role != "local" and "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
            # one NIXL side channel per engine process (the local stack hands each actor its own
            # port in its environment; elsewhere: one chosen here, outside the ephemeral range)
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(listen_ports(1)[0])
            os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        if role != "local":
            nixl_without_progress_thread()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.cfg = cfg
        self.role = role
        self.model_dir = model_dir
        kw = engine_kwargs(
            cfg,
            model_dir,
            role,
            kv_events_endpoint=events_endpoint,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            store=store is not None and role == "prefill",
        )
        if kv_cache_blocks is None and os.environ.get(KV_CACHE_BLOCKS_ENV):
            kv_cache_blocks = int(os.environ[KV_CACHE_BLOCKS_ENV])
        if kv_cache_blocks is not None:
            if kv_cache_blocks < 1:
                raise ConfigError("engine", "%s must be a positive page count" % KV_CACHE_BLOCKS_ENV)
            kw["num_gpu_blocks_override"] = kv_cache_blocks
        logger.info("%s: starting vLLM (%s) with %s", instance, role, kw)
        with one_gloo_device(), kept_cpu_affinity():
            self.engine = LLMEngine.from_engine_args(EngineArgs(**kw), enable_multiprocessing=False)
        #: whether vLLM checkpoints junctions at their exact position (its scheduler's
        #: narrowed ``enable_mamba_shared_prefix_checkpoint``; None: no in-process scheduler)
        self.shared_prefix_checkpoint: bool | None = None
        self._check_shared_prefix_option(bool(kw.get(SHARED_PREFIX_OPTION)))
        #: the store segment this engine's store puts go to (``patches.store_puts_to_own_segment``)
        self.store_segment = store_puts_to_own_segment() if store is not None and role == "prefill" else None
        self.model_id = engine_identity(cfg, model_dir)  # the weights' digest, vLLM's version, ...
        self.unit = cfg.prefix_match_unit
        self.hasher = BlockHasher(unit=self.unit, algo=cfg.hash_algo, seed=cfg.hash_seed)
        self.spec = SpecStats()  # vLLM reports speculative decoding in its own metrics
        self.live: dict[str, _Live] = {}
        self.handoffs: dict[str, VllmTicket] = {}
        #: when the newest P/D prefill finished here (its KV handed to decode: ``SEND_HOLD_S``)
        self._handed_at = -SEND_HOLD_S
        self.pending: list[RequestOutput] = []
        #: vLLM's KV events, translated (None: not asked for)
        self.feed: KVEventFeed | None = None
        if events_endpoint is not None:
            self.feed = KVEventFeed(self.hasher, self._groups())
            self.feed.start(events_endpoint)
        #: prompt tokens a P/D prefill does not compute (vLLM's NixlConnector truncates them:
        #: decode recomputes them on top of the pulled KV and state); its tail is where N - this is
        self.prefill_backoff = self._prefill_backoff() if role == "prefill" else 0
        #: prompts waiting for their checkpoint prefixes (``stages.py``)
        self.stages = Stages()
        #: checkpoint prefixes in vLLM: our request id -> (vLLM's request id, prefix length)
        self._prefixes: dict[str, tuple[str, int]] = {}
        #: background requests (answer checkpoints), run only while no foreground one is live
        self.background = BackgroundQueue()
        sched = require(self._core(), "scheduler", "EngineCore")
        #: whether this engine's hits drop a unit for an EAGLE-family drafter (vLLM's scheduler says)
        self.drop_eagle_block = bool(require(sched, "use_eagle_block_drop", "Scheduler"))
        #: whether vLLM hits at prefix_match_unit granularity inside its blocks (else extras are not staged)
        self.partial_hits = bool(require(sched, "mamba_partial_cache_hit", "Scheduler"))

    def _check_shared_prefix_option(self, asked: bool) -> None:
        """Read back what vLLM made of ``enable_mamba_shared_prefix_checkpoint``: it
        turns the option off itself when the prefix match unit is not below its
        scheduler block or under multi-module MTP (``args.shared_prefix_checkpoint``)."""
        core = self._core()
        sched = getattr(core, "scheduler", None) if core is not None else None
        if sched is None or not hasattr(sched, "mamba_shared_prefix_checkpoint"):
            return
        self.shared_prefix_checkpoint = bool(sched.mamba_shared_prefix_checkpoint)
        if asked and not self.shared_prefix_checkpoint:
            log_once(
                "vLLM junction checkpoints (%s) asked for but turned off by vLLM for a %s engine: it needs"
                " prefix_match_unit (%d) below its scheduler block (%s tokens, partial hits %s) and no"
                " multi-module MTP",
                SHARED_PREFIX_OPTION,
                self.role,
                self.cfg.prefix_match_unit,
                getattr(sched, "block_size", "?"),
                getattr(sched, "mamba_partial_cache_hit", "?"),
            )

    def _groups(self) -> dict[int, GroupSpec]:
        """The engine's KV-cache groups, as its KV events name them (kind, block size)."""
        core = self._core()
        mgr = getattr(getattr(core, "scheduler", None), "kv_cache_manager", None)
        meta = getattr(mgr, "kv_cache_event_metadata", None)
        config = getattr(mgr, "kv_cache_config", None)
        if meta is None or config is None:
            logger.warning("vLLM's KV-cache groups not readable: their kinds are learned from its events")
            return {}
        return {
            i: GroupSpec(str(kind), int(group.kv_cache_spec.block_size))
            for i, ((kind, _), group) in enumerate(zip(meta, config.kv_cache_groups, strict=True))
        }

    def _prefill_backoff(self) -> int:
        """vLLM 0.32's ``NixlConnectorScheduler._prefill_backoff``: one token for a
        model with Mamba groups, more for multi-module MTP's lookahead."""
        kinds = {g.kind for g in self._groups().values()}
        core = self._core()
        lookahead = int(getattr(getattr(core, "vllm_config", None), "num_prefill_lookahead_tokens", 1) or 1)
        return max(1 if "mamba" in kinds else 0, lookahead - 1)

    def computed_prompt_tokens(self, request: EngineRequest, prefill_only: bool) -> int:
        """The prompt tokens this engine computes for ``request``: all of them, or
        on a P/D prefill all but the ``prefill_backoff`` tokens decode recomputes."""
        n = len(request.prompt_token_ids)
        return n - self.prefill_backoff if prefill_only and n > self.prefill_backoff else n

    # -- requests ----------------------------------------------------------------------
    def _submit(self, req: EngineRequest, max_tokens: int, transfer: dict[str, Any] | None, *, full: bool) -> None:
        """Hand ``req`` to vLLM: ``full`` with every sampling field (local and decode
        requests), else plain (a P/D prefill, a checkpoint prefix, a background try:
        ``sampling.py``). vLLM's refusal of a request is ours (InvalidRequestError)."""
        from vllm.exceptions import VLLMClientError

        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        try:
            internal = self.engine.add_request(
                req.request_id, prompt, vllm_sampling(req.sampling, max_tokens, transfer, full=full)
            )
        except VLLMClientError as e:
            raise InvalidRequestError(str(e)) from e
        if self.stages.is_prefix(req.request_id):  # released once its checkpoint is written
            self._prefixes[req.request_id] = (str(internal), len(req.prompt_token_ids))

    def _check_sampling(self, request: EngineRequest) -> None:
        """Refuse on a P/D prefill what decode would refuse of ``request``'s sampling
        (vLLM's own checks: ranges, token ids, the grammar's syntax), before any prompt
        token is computed (and on a local engine before its checkpoint prefixes); the
        prefill itself samples plainly. A prefill cannot check what only decode's
        configuration refuses (vLLM refuses ``logit_bias`` with speculative decoding)."""
        sp = request.sampling
        if not (sp.processes_logits or sp.structured is not None or sp.logprobs is not None):
            return
        from vllm.exceptions import VLLMClientError

        config = self.engine.vllm_config
        try:
            full = vllm_sampling(sp, sp.max_tokens, None, full=True)
            spec = config.speculative_config if self.role != "prefill" else None  # decode's is not known here
            full.verify(config.model_config, spec, config.structured_outputs_config, self.engine.get_tokenizer())
        except VLLMClientError as e:
            raise InvalidRequestError(str(e)) from e

    def add_request(self, request: EngineRequest, prefill_only: bool = False) -> None:
        """Queue ``request``; ``prefill_only`` stops after the first token and keeps
        the KV for a decode engine to pull (role ``prefill``)."""
        if request.request_id in self.live:
            raise InvalidRequestError("duplicate request id %s" % request.request_id)
        if prefill_only and self.role != "prefill":
            raise InvalidRequestError("prefill_only needs an engine in the prefill role, not %s" % self.role)
        if request.background:
            if prefill_only or self.role == "decode":
                raise InvalidRequestError("a background request runs whole on a local or prefill engine")
            self._register(request)
            # handed to vLLM by step() once no foreground request is live; what is cached now is its hit
            self.background.add(request, self.local_hit(request.prompt_token_ids, request.cache_salt))
            self.live[request.request_id] = _Live(request, False)
            return
        transfer = {"do_remote_decode": True, "do_remote_prefill": False} if prefill_only else None
        max_tokens = 1 if prefill_only else request.sampling.max_tokens
        stages = self._stages(request, prefill_only)
        if prefill_only or stages:  # vLLM sees its full sampling only on decode, or after the prefixes
            self._check_sampling(request)
        self._register(request)
        tail = self._tail_stage(request, prefill_only)
        # the store lookup (a round trip to the store's master) only where staging needs it: a
        # tail stage runs in the background, where vLLM's own lookup loads what the store holds
        if stages:
            hit = self.cached_hit(request)
        else:
            hit = self.local_hit(request.prompt_token_ids, request.cache_salt) if tail else 0
        first = self.stages.start(request, tuple((p, n) for p, n in stages if p > hit))
        try:
            if first is not None:
                self._submit(first, 1, None, full=False)
            else:
                self._submit(request, max_tokens, transfer, full=not prefill_only)
        except Exception:
            self.stages.abort(request.request_id)
            raise
        self.live[request.request_id] = _Live(request, prefill_only)
        if tail is not None and tail.position > hit and len(self.background.queued) < TAIL_QUEUE_LIMIT:
            self.background.add(tail.request, 0)  # runs once no foreground request is live
        preempted = self.background.preempt()
        if preempted is not None:  # never let a background prefill hold a chunk foreground work needs
            self.engine.abort_request([preempted])

    def _register(self, request: EngineRequest) -> None:
        """Tell the event feed the prompt's chain before vLLM can publish any of it."""
        if self.feed is not None and self.cfg.enable_prefix_caching:
            self.feed.register_prompt(self.hasher.chain(request.prompt_token_ids, cache_salt=request.cache_salt))

    def _admit_background(self) -> None:
        foreground = any(not v.request.background for v in self.live.values()) or self._sending()
        nxt = self.background.admit(foreground)
        if nxt is None:
            return
        try:
            self._submit(nxt, nxt.sampling.max_tokens, None, full=False)  # no one reads its token
        except Exception:
            running = self.background.running
            self.background.finished()
            self._fail(running[1].request_id if running is not None else nxt.request_id)

    def _sending(self) -> bool:
        """Whether a handed-off prefill's KV still waits for decode's read (vLLM keeps
        its blocks until NIXL reports it sent), for at most ``SEND_HOLD_S``."""
        if not self.background.queued or time.monotonic() - self._handed_at >= SEND_HOLD_S:
            return False
        core = self._core()
        return core is not None and core.scheduler.has_finished_requests()

    def _fail(self, request_id: str) -> None:
        """vLLM refused a request this engine submits on its own (a checkpoint prefix's
        prompt, a background try): that request ends aborted, the others run on."""
        logger.exception("vLLM refused %s: it ends aborted", request_id)
        live = self.live.pop(request_id, None)
        if live is not None:
            self.pending.append(self._output(live.request, (), True, FinishReason.ABORT, 0))

    def cached_hit(self, request: EngineRequest) -> int:
        """Where ``request`` would start computing now: the longer of vLLM's local
        prefix-cache hit and its MooncakeStore hit. Staging stays past it, so a
        prefix never recomputes (and never reports as the prompt's hit) a state the
        store would load whole; a router placement from an index that did not yet
        show the store's entries is dropped here."""
        hit = self.local_hit(request.prompt_token_ids, request.cache_salt)
        return max(hit, self.store_hit(request.prompt_token_ids, request.cache_salt))

    def checkpoint_plan(self, request: EngineRequest, prefill_only: bool, hit: int) -> tuple[tuple[int, int], ...]:
        """The ``(position, prefix length)`` prefixes prefilled before ``request``
        so that vLLM keeps a state at each of its extra checkpoints, each past
        ``hit`` (what the prompt finds cached: a prefix below it would recompute
        what is cached): ``checkpoint_stages.staged_checkpoints`` of the tokens this
        engine computes (at most ``max_extra_checkpoints`` requested ones, and the
        router's placement; the prompt's own tail on a P/D prefill, ``_tail_stage``,
        runs in the background after it and is not one of them). None on a decode engine,
        without prefix caching, or where vLLM cannot hit at unit granularity
        (``mamba_partial_cache_hit``: then it hits whole blocks only)."""
        return tuple((p, n) for p, n in self._stages(request, prefill_only) if p > hit)

    def _stages(self, request: EngineRequest, prefill_only: bool) -> tuple[tuple[int, int], ...]:
        """``checkpoint_plan`` before the hit is known (the hit costs a store lookup)."""
        if not self.cfg.enable_prefix_caching or self.role == "decode":
            return ()
        if not (request.checkpoints or request.placement):
            return ()
        if not self.partial_hits:
            log_once("vLLM hits whole blocks only here (no partial hash hits): extra checkpoints are not staged")
            return ()
        return staged_checkpoints(
            request.checkpoints,
            self.computed_prompt_tokens(request, prefill_only),
            self.unit,
            self.drop_eagle_block,
            self.cfg.max_extra_checkpoints,
            placed=request.placement,
        )

    def _tail_stage(self, request: EngineRequest, prefill_only: bool) -> TailStage | None:
        """The background prefix that leaves ``request``'s own tail where its P/D
        truncation drops it a unit (``checkpoint_stages.truncated_tail_stage``): after the
        prompt it hits the truncated tail and computes ``u + 1`` tokens (an answer
        prefill's terms: only while no foreground request is live, aborted for one
        that arrives). None off a P/D prefill, where vLLM hits whole blocks only, or
        with ``vllm_tail_stage`` off."""
        n, computed = len(request.prompt_token_ids), self.computed_prompt_tokens(request, prefill_only)
        if computed == n or not self.cfg.enable_prefix_caching or not self.partial_hits or not self.cfg.vllm_tail_stage:
            return None
        found = truncated_tail_stage(n, computed, self.unit, self.drop_eagle_block)
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

    def _resume(self, request_id: str, cached: int) -> None:
        """A checkpoint prefix finished: submit the next one, or the prompt."""
        nxt = self.stages.finished(request_id, cached)
        if nxt is None:
            return
        main = self.stages.owner.get(nxt.request_id, nxt.request_id)
        try:
            if self.stages.is_prefix(nxt.request_id):
                self._submit(nxt, 1, None, full=False)
                return
            live = self.live[nxt.request_id]
            transfer = {"do_remote_decode": True, "do_remote_prefill": False} if live.prefill_only else None
            max_tokens = 1 if live.prefill_only else nxt.sampling.max_tokens
            self._submit(nxt, max_tokens, transfer, full=not live.prefill_only)
        except Exception:
            self.stages.abort(main)
            self._fail(main)

    def pop_handoff(self, request_id: str) -> VllmTicket | None:
        return self.handoffs.pop(request_id, None)

    def prepare_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> int:
        """Nothing held: vLLM's connector pulls the whole prompt (no delta handoffs)."""
        return 0

    def fetch_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> VllmTicket:
        """Nothing to move here: vLLM's connector pulls KV and state during steps."""
        if not isinstance(ticket, VllmTicket):
            raise InvalidRequestError("a vLLM decode engine cannot continue a %s" % type(ticket).__name__)
        return ticket

    def add_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> None:
        """Continue a request prefilled elsewhere: vLLM pulls its KV and state over NIXL
        and generates every output token."""
        ticket = self.fetch_handoff(request, ticket)
        if request.request_id in self.live:
            raise InvalidRequestError("duplicate request id %s" % request.request_id)
        self._submit(request, request.sampling.max_tokens, dict(ticket.kv_transfer_params), full=True)
        self.live[request.request_id] = _Live(request, False, handoff=ticket)

    def abort(self, request_id: RequestId | str) -> bool:
        if self.live.pop(request_id, None) is None:
            return False
        tail = self.background.drop(request_id + TAIL_SUFFIX)  # its tail stage: no one waits for it
        if tail is not None:
            self.engine.abort_request([tail])
        if self.background.queued or self.background.running is not None:
            running = self.background.drop(request_id)
            if running is not None:
                self.engine.abort_request([running])
                return True
        prefix = self.stages.abort(request_id)
        self.engine.abort_request([prefix if prefix is not None else request_id])
        return True

    def has_work(self) -> bool:
        """Unfinished requests, or finished ones whose KV a connector still holds
        (prefill keeps blocks until decode's NIXL read is acknowledged: only
        stepping the engine core processes that acknowledgement and frees them)."""
        if self.pending or self.background.queued or self.engine.has_unfinished_requests():
            return True
        core = self._core()
        return core is not None and core.scheduler.has_requests()

    # -- stepping ----------------------------------------------------------------------
    @staticmethod
    def _output(
        req: EngineRequest,
        tokens: tuple[int, ...],
        finished: bool,
        reason: FinishReason | None,
        cached: int,
        logprobs: tuple[TokenLogprobs, ...] | None = None,
    ) -> RequestOutput:
        return RequestOutput(req.request_id, tokens, finished, reason, len(req.prompt_token_ids), cached, logprobs)

    def step(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        if not self.live and not outputs:
            # only connector bookkeeping left: poll it, do not spin
            time.sleep(SEND_POLL_S if time.monotonic() - self._handed_at < SEND_HOLD_S else IDLE_POLL_S)
        self._admit_background()
        for out in self.engine.step():
            if self.stages.is_prefix(out.request_id):  # a checkpoint prefix: never reported
                if out.finished:
                    self._resume(out.request_id, int(out.num_cached_tokens or 0))
                continue
            rid = self.background.owner(out.request_id) or out.request_id
            background = rid != out.request_id
            if background and out.finished:
                self.background.finished()
            live = self.live.get(rid)
            if live is None:  # aborted meanwhile, a preempted background try, or a tail stage (ours)
                if background and out.finished:
                    self.background.forget(rid)
                continue
            comp = out.outputs[0]
            tokens = tuple(comp.token_ids)
            cached = self.stages.reported_hit(rid, int(out.num_cached_tokens or 0), out.finished)
            if background:  # not what an earlier, preempted try of it left
                cached = self.background.reported_hit(rid, cached, out.finished)
            if live.handoff is not None:
                cached = live.handoff.num_cached_tokens
            reason = _FINISH_REASONS.get(str(comp.finish_reason), FinishReason.STOP) if out.finished else None
            logprobs = None
            k = live.request.sampling.logprobs
            if k is not None and comp.logprobs is not None and not live.prefill_only and not background:
                logprobs = token_logprobs(tokens, comp.logprobs, k)  # vLLM's, of a request sampled in full
            if live.prefill_only and out.finished:
                params = out.kv_transfer_params or {}
                if params:  # handed off: finished here, not for the client
                    self.handoffs[rid] = VllmTicket(rid, 0, None, cached, params)
                    self._handed_at = time.monotonic()
                    reason = None
                tokens = ()  # not an output token (see the module docstring)
            outputs.append(self._output(live.request, tokens, out.finished, reason, cached, logprobs))
            if out.finished:
                del self.live[rid]
        self._release_prefixes()
        return outputs

    def _release_prefixes(self) -> None:
        """Checkpoint prefixes whose chunk up to their last token ran this step:
        vLLM wrote (and keyed) the state at their checkpoint when it scheduled that
        chunk, so each is aborted before its one sampled token and the next prefix,
        or the prompt, goes on at once (one engine step per prefix instead of two;
        the checkpoint stays cached as a finished prefix's does, the freed blocks
        keep their keys)."""
        if not self._prefixes:
            return
        core = self._core()
        for rid, (internal, length) in list(self._prefixes.items()):
            if not self.stages.is_prefix(rid):  # finished, or its prompt was aborted
                del self._prefixes[rid]
                continue
            vreq = core.scheduler.requests.get(internal) if core is not None else None
            stats = getattr(vreq, "prefill_stats", None)
            if vreq is None or stats is None or vreq.num_computed_tokens < length - 1:
                continue
            if getattr(vreq, "num_in_flight_tokens", 0):
                continue
            del self._prefixes[rid]
            self.engine.abort_request([rid])
            self.stages.prefixes_released += 1
            self._resume(rid, int(stats.num_cached_tokens))

    def generate(self, requests: list[EngineRequest]) -> dict[str, list[int]]:
        """Run ``requests`` to completion (tests, benchmarks)."""
        for r in requests:
            self.add_request(r)
        out: dict[str, list[int]] = {r.request_id: [] for r in requests}
        while self.has_work():
            for o in self.step():
                out[o.request_id].extend(o.new_token_ids)
        return out

    def pop_exports(self) -> list[tuple[KVExport, StateCheckpoint]]:
        """Checkpoints go to the store through vLLM's connector, not through us."""
        return []

    def pop_cache_events(self) -> list[CacheEvent]:
        return self.feed.pop() if self.feed is not None else []

    def import_checkpoint(
        self, kv: KVExport, state: StateCheckpoint, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> bool:
        """Never imports: store hits enter through vLLM's MooncakeStoreConnector
        (``imports_checkpoints`` is False, so workers do not call this)."""
        return False

    def local_hit(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """What vLLM's local prefix cache would restore for ``token_ids`` now: its own
        admission lookup (``KVCacheManager.get_computed_blocks``, which reads the
        block pool's hash table only) on a request hashed by its engine core; 0
        without prefix caching. The worker asks before an answer prefill."""
        core = self._core()
        if core is None or not self.cfg.enable_prefix_caching or len(token_ids) < 2:
            return 0
        return int(core.scheduler.kv_cache_manager.get_computed_blocks(self._probe(core, token_ids, cache_salt))[1])

    def store_hit(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """What vLLM's MooncakeStoreConnector would load for ``token_ids`` now: its
        scheduler's own store lookup (``LookupKeyClient.lookup``, a read of the
        store's keys) on a probe request; 0 without a store connector or when the
        lookup fails (then staging may recompute what the store holds, never more)."""
        core = self._core()
        if core is None or not self.cfg.enable_prefix_caching or len(token_ids) < 2:
            return 0
        store = _store_scheduler(getattr(core.scheduler, "connector", None))
        if store is None or not store.enable_lookup:
            return 0
        probe = self._probe(core, token_ids, cache_salt)
        try:
            found = store.client.lookup("hybridpd-store-probe", probe.num_tokens, probe.block_hashes)
        except Exception:  # the store is a cache: staging then treats it as empty
            logger.warning("MooncakeStore lookup failed: staging ignores the store", exc_info=True)
            return 0
        return int(found.hit_length) if found is not None else 0

    @staticmethod
    def _probe(core: Any, token_ids: Sequence[int], cache_salt: str | None) -> Any:
        """A request vLLM never runs, hashed by ``core``'s block hasher, for lookups."""
        from vllm.sampling_params import SamplingParams as VllmSampling
        from vllm.v1.request import Request

        return Request(
            "hybridpd-probe", list(token_ids), VllmSampling(max_tokens=1), None,
            cache_salt=cache_salt, block_hasher=core.request_block_hasher,
        )  # fmt: skip

    def handoff_stats(self) -> HandoffStats:
        """vLLM's connector owns its handoffs (its own metrics count them)."""
        return HandoffStats()

    def inject_fault(self, kind: str) -> None:
        raise ValueError("unknown fault %r (the vLLM engine injects none)" % kind)

    def tail_checkpoint(self, request: EngineRequest, num_cached: int, prefill_only: bool) -> int:
        """vLLM caches the state (and a partial attention entry) at the last unit
        boundary its prompt allows: ``(N' - 1) // u * u`` of the N' tokens it computes
        (``computed_prompt_tokens``: N - 1 on a P/D prefill), whatever the hit (vLLM
        0.32 ``FullAttentionManager._cache_partial_tail_block`` and the Mamba
        manager's tail)."""
        if not self.cfg.enable_prefix_caching:
            return 0
        return checkpoint_position(self.computed_prompt_tokens(request, prefill_only), self.unit, False)

    def extra_checkpoints(self, request: EngineRequest, num_cached: int, prefill_only: bool) -> tuple[int, ...]:
        """The positions of ``checkpoint_plan`` past the hit: each prefix's tail checkpoint."""
        return tuple(p for p, _ in self.checkpoint_plan(request, prefill_only, num_cached))

    def queued_prompt_tokens(self) -> int:
        return sum(len(v.request.prompt_token_ids) for v in self.live.values() if v.prefill_only)

    # -- accounting --------------------------------------------------------------------
    def _core(self) -> Any:
        return getattr(self.engine.engine_core, "engine_core", None)  # in-process client -> EngineCore

    def _block_pool(self) -> Any:
        core = self._core()
        return core.scheduler.kv_cache_manager.block_pool if core is not None else None

    def stats(self) -> PoolStats:
        pool = self._block_pool()
        total = pool.num_gpu_blocks - 1 if pool is not None else 0  # vLLM reserves one null block
        free = pool.get_num_free_blocks() if pool is not None else 0
        running = sum(1 for v in self.live.values())
        # prefix-cache entries, (hash, group) keys: O(1); a page holding a partial entry besides
        # its full one counts twice (counting pages would walk the pool on every load report)
        cached = len(pool.cached_block_hash_to_block) if pool is not None else 0
        return PoolStats(total, free, cached, 0, 0, running, 0, self._page_bytes())

    def _page_bytes(self) -> int:
        """One page of vLLM's block pool (every group's block is padded to it)."""
        core = self._core()
        groups = core.scheduler.kv_cache_config.kv_cache_groups if core is not None else ()
        return max((int(g.kv_cache_spec.page_size_bytes) for g in groups), default=0)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
        try:
            self.engine.engine_core.shutdown()
        except Exception:  # already down
            logger.debug("vLLM shutdown failed", exc_info=True)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def _store_scheduler(connector: Any) -> Any:
    """The MooncakeStoreConnector scheduler side of vLLM's connector (alone or
    inside a MultiConnector), or None."""
    if connector is None:
        return None
    found = getattr(connector, "connector_scheduler", None)
    if found is not None and hasattr(found, "client") and hasattr(found, "enable_lookup"):
        return found
    for sub in getattr(connector, "sub_connectors", ()):  # MultiConnector: a property
        found = _store_scheduler(sub)
        if found is not None:
            return found
    return None
