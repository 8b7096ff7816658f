"""vLLM, reached from this file only: the release check, our scheduler subclass
(vLLM's ``scheduler_cls`` extension point: :func:`scheduler_class`), and every vLLM
symbol and engine internal the vLLM engine builds, reads or patches.

A vLLM release may rename any internal read here; read fail-open, a rename would
silently turn a feature off. So the release is checked first (:data:`SUPPORTED`,
:func:`check_installed`); what is read at start-up goes through :func:`require`,
which names what is missing (StartupError); what is read later is read directly
(an AttributeError where vLLM moved it). No read of a vLLM object defaults; each
``None`` a function returns is one vLLM itself holds (each says when).

``tests/unit/test_vllm_adapter.py`` fails where another file of ``hybridpd/``,
``services/``, ``launch/`` or ``bench/`` imports vLLM or reaches into its engine;
vLLM is imported inside each function, so this module imports without it.
``tests/vllm/test_patch_targets.py`` checks what ``patches.py`` and the scheduler
subclass rebind, override or read.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridpd.engine.vllm.sequencer import Ledger, Sequencer, Tag
from hybridpd.errors import StartupError

#: vLLM releases (version prefixes) whose internals this engine was written and tested against
SUPPORTED = ("0.32.",)


def check_version(version: str) -> None:
    """StartupError unless ``version`` (``vllm.__version__``) is a supported release."""
    if not version.startswith(SUPPORTED):
        raise StartupError(
            "vLLM %s is not supported: hybridpd's vLLM engine reads internals of vLLM %s"
            " (engine/vllm/adapter.py); install that release in the vLLM environment"
            % (version, " or ".join(v + "x" for v in SUPPORTED))
        )


def check_installed() -> None:
    """StartupError unless the installed vLLM is a supported release (ImportError without one)."""
    import vllm

    check_version(vllm.__version__)


def require(obj: Any, name: str, where: str) -> Any:
    """``obj.name``; StartupError naming ``where.name`` when vLLM has no such attribute."""
    if obj is None or not hasattr(obj, name):
        raise StartupError(
            "vLLM has no %s.%s, which the vLLM engine reads (engine/vllm/adapter.py): a vLLM release"
            " this hybridpd was not written for?" % (where, name)
        )
    return getattr(obj, name)


# -- the engine ----------------------------------------------------------------------------
def llm_engine(kwargs: Mapping[str, Any]) -> Any:
    """vLLM's ``LLMEngine`` from ``EngineArgs(**kwargs)``, its engine core in this process."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(**kwargs), enable_multiprocessing=False)


def in_process_core(engine: Any) -> Any:
    """The ``EngineCore`` inside ``engine`` (``LLMEngine.engine_core``, its in-process client)."""
    client = require(engine, "engine_core", "LLMEngine")
    return require(client, "engine_core", type(client).__name__)


def shutdown(engine: Any) -> None:
    """Stop ``engine``'s engine core (its executor, its connectors' threads)."""
    engine.engine_core.shutdown()


def client_error() -> type[Exception]:
    """The exception vLLM raises for a request it refuses (``VLLMClientError``)."""
    from vllm.exceptions import VLLMClientError

    return VLLMClientError


def event_hashes_are_ints() -> bool:
    """Whether vLLM's KV events carry 64-bit ints, not full block hashes (its frozen
    ``vllm.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    from vllm import envs

    return bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)


def kv_event_batch_type() -> type:
    """The class vLLM's KV-event publisher encodes (msgpack), to decode its messages."""
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch


# -- sampling ------------------------------------------------------------------------------
def sampling_params(fields: Mapping[str, Any]) -> Any:
    """vLLM's ``SamplingParams(**fields)``, its outputs as deltas (``RequestOutputKind.DELTA``)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(output_kind=RequestOutputKind.DELTA, **fields)


def structured_outputs_params(fields: Mapping[str, Any]) -> Any:
    """vLLM's ``StructuredOutputsParams(**fields)``."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**fields)


def verify_sampling(engine: Any, params: Any, speculative: bool) -> None:
    """vLLM's own checks of ``params`` against ``engine``'s model, structured-output
    config and tokenizer (``SamplingParams.verify``), with its speculative config when
    ``speculative``; raises :func:`client_error`'s type."""
    config = engine.vllm_config
    spec = config.speculative_config if speculative else None
    params.verify(config.model_config, spec, config.structured_outputs_config, engine.get_tokenizer())


# -- the scheduler -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SchedulerRules:
    """What vLLM's scheduler made of our arguments: its hit rules."""

    #: its scheduler block, in tokens
    block_size: int
    #: whether its hits drop a unit for an EAGLE-family drafter (``use_eagle_block_drop``)
    eagle_block_drop: bool
    #: whether it hits at prefix_match_unit granularity inside its blocks (``mamba_partial_cache_hit``)
    partial_hits: bool
    #: whether it checkpoints junctions at their exact position (``mamba_shared_prefix_checkpoint``)
    shared_prefix_checkpoint: bool


def scheduler_rules(core: Any) -> SchedulerRules:
    """``core``'s scheduler's hit rules, read at start-up."""
    sched = require(core, "scheduler", "EngineCore")
    return SchedulerRules(
        block_size=int(require(sched, "block_size", "Scheduler")),
        eagle_block_drop=bool(require(sched, "use_eagle_block_drop", "Scheduler")),
        partial_hits=bool(require(sched, "mamba_partial_cache_hit", "Scheduler")),
        shared_prefix_checkpoint=bool(require(sched, "mamba_shared_prefix_checkpoint", "Scheduler")),
    )


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One KV-cache group of the engine, as its KV events name it."""

    #: ``full_attention``, ``mamba``, ... (``KVCacheManager.kv_cache_event_metadata``)
    kind: str
    #: its block, in tokens
    block_size: int
    #: one page of it in the block pool, in bytes
    page_bytes: int


def kv_cache_groups(core: Any) -> tuple[KVCacheGroup, ...]:
    """``core``'s KV-cache groups, in vLLM's group order (the events' ``group_idx``)."""
    mgr = require(require(core, "scheduler", "EngineCore"), "kv_cache_manager", "Scheduler")
    meta = require(mgr, "kv_cache_event_metadata", "KVCacheManager")
    config = require(mgr, "kv_cache_config", "KVCacheManager")
    return tuple(
        KVCacheGroup(str(kind), int(group.kv_cache_spec.block_size), int(group.kv_cache_spec.page_size_bytes))
        for (kind, _), group in zip(meta, config.kv_cache_groups, strict=True)
    )


def prefill_lookahead_tokens(core: Any) -> int:
    """Prefill tokens past the computed range ``core``'s drafter reads (``VllmConfig.num_prefill_lookahead_tokens``)."""
    config = require(core, "vllm_config", "EngineCore")
    return int(require(config, "num_prefill_lookahead_tokens", "VllmConfig"))


def has_requests(core: Any) -> bool:
    """Whether ``core``'s scheduler holds any request, finished ones included."""
    return bool(core.scheduler.has_requests())


@dataclass(frozen=True, slots=True)
class PoolCounts:
    """vLLM's block pool, counted: its pages (less the null block vLLM reserves), free
    pages, and prefix-cache entries ((hash, group) keys)."""

    total: int
    free: int
    cached: int


def block_pool_counts(core: Any) -> PoolCounts:
    """``core``'s block pool's pages and prefix-cache entries (each O(1))."""
    pool = core.scheduler.kv_cache_manager.block_pool
    return PoolCounts(pool.num_gpu_blocks - 1, pool.get_num_free_blocks(), len(pool.cached_block_hash_to_block))


SCHEDULER_METHODS = ("add_request", "finish_requests", "get_num_unfinished_requests", "schedule", "_preempt_request")
SCHEDULER_FIELDS = ("requests", "running", "waiting", "kv_holding_waiting", "finished_req_ids")


def scheduler_class(ledger: Ledger) -> type:
    """vLLM's ``Scheduler`` with a ``Sequencer`` deciding before each step which of our
    tagged requests its queues take (``sequencer.py``), one class per engine's ``ledger``;
    it overrides or calls :data:`SCHEDULER_METHODS`, and reads :data:`SCHEDULER_FIELDS`."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler as Scheduler  # the engine's: async_scheduling
    from vllm.v1.request import RequestStatus

    for name in SCHEDULER_METHODS:
        require(Scheduler, name, "Scheduler")

    class HybridpdScheduler(Scheduler):
        """vLLM's scheduler; our requests reach its queues when the sequencer lets them."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for name in SCHEDULER_FIELDS:
                require(self, name, "Scheduler")
            self.sequencer = Sequencer(ledger)

        def add_request(self, request: Any) -> None:
            if self.sequencer.arrive(request, Tag.of(request.sampling_params.extra_args)):
                super().add_request(request)

        def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
            ids = None if request_ids is None else [request_ids] if isinstance(request_ids, str) else list(request_ids)
            self.sequencer.forget(ids)
            return super().finish_requests(ids, finished_status)

        def get_num_unfinished_requests(self) -> int:
            return int(super().get_num_unfinished_requests()) + self.sequencer.held_count()

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            self.sequencer.before_step(self, time.monotonic())
            out = super().schedule(*args, **kwargs)
            self.sequencer.after_schedule()
            return out

        # -- sequencer.Queues ----------------------------------------------------------------
        def queue(self, request: Any) -> None:
            if request.request_id in self.requests:  # taken out before: back at the head
                self.waiting.prepend_request(request)
            else:
                Scheduler.add_request(self, request)

        def release(self, request: Any) -> None:
            super().finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)

        def take_out(self, request: Any) -> bool:
            running = request.status == RequestStatus.RUNNING
            if running:
                self.running.remove(request)
                self._preempt_request(request, time.monotonic())
            if request in self.waiting:
                self.waiting.remove_request(request)
            return running

        def queued(self) -> Any:
            return itertools.chain(self.running, self.waiting, self.kv_holding_waiting)

        def sending(self) -> bool:
            return bool(self.finished_req_ids) or any(r.is_finished() for r in self.requests.values())

    return HybridpdScheduler


# -- what its caches hold ------------------------------------------------------------------
def probe_request(core: Any, token_ids: Sequence[int], cache_salt: str | None) -> Any:
    """A ``Request`` vLLM never runs, hashed by ``core``'s block hasher, for lookups."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        "hybridpd-probe", list(token_ids), SamplingParams(max_tokens=1), None,
        cache_salt=cache_salt, block_hasher=core.request_block_hasher,
    )  # fmt: skip


def computed_tokens(core: Any, probe: Any) -> int:
    """The tokens ``core``'s local prefix cache holds for ``probe``: its admission lookup
    (``KVCacheManager.get_computed_blocks``, which reads the block pool's hash table only)."""
    return int(core.scheduler.kv_cache_manager.get_computed_blocks(probe)[1])


def _store_connector(connector: Any) -> Any:
    """The MooncakeStoreConnector among ``connector`` (itself, or a MultiConnector's part), or None."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    if isinstance(connector, MooncakeStoreConnector):
        return connector
    if isinstance(connector, MultiConnector):
        for sub in connector.sub_connectors:
            found = _store_connector(sub)
            if found is not None:
                return found
    return None


def store_scheduler(core: Any) -> Any:
    """The scheduler side (``MooncakeStoreScheduler``) of ``core``'s MooncakeStoreConnector;
    None without one (vLLM's ``Scheduler.connector`` is None without a KV-transfer config)."""
    connector = core.scheduler.connector
    store = _store_connector(connector) if connector is not None else None
    return store.connector_scheduler if store is not None else None


def store_lookup_enabled(store: Any) -> bool:
    """Whether ``store`` (:func:`store_scheduler`) looks prompts up in the store."""
    return bool(store.enable_lookup)


def store_hit_tokens(store: Any, probe: Any) -> int:
    """The tokens ``store`` would load for ``probe`` now: its own lookup
    (``LookupKeyClient.lookup``, a read of the store's keys); raises where it fails."""
    found = store.client.lookup("hybridpd-store-probe", probe.num_tokens, probe.block_hashes)
    return int(found.hit_length) if found is not None else 0  # None: not ready (a non-blocking lookup)


# -- what patches.py rebinds or reads ------------------------------------------------------
def nixl_agent_config() -> Callable[..., Any] | None:
    """The factory vLLM's NixlConnector worker calls for its NIXL agent's config
    (``nixl.base_worker.nixl_agent_config``); None where NIXL's Python API is not
    installed (vLLM binds it so)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    factory: Callable[..., Any] | None = require(base_worker, "nixl_agent_config", "nixl.base_worker")
    return factory


def set_nixl_agent_config(factory: Callable[..., Any]) -> None:
    """Rebind the factory :func:`nixl_agent_config` returns (the worker reads it at call time)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    base_worker.nixl_agent_config = factory


def store_worker() -> Any:
    """The worker side (``MooncakeStoreWorker``) of this process's MooncakeStoreConnector
    (its KV-transfer group's, alone or in a MultiConnector); None without one."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    store = _store_connector(get_kv_transfer_group()) if has_kv_transfer_group() else None
    return store.connector_worker if store is not None else None


def store_put_configs(worker: Any) -> tuple[Any, ...]:
    """The Mooncake ``ReplicateConfig`` objects ``worker``'s puts read: its own first,
    then its send thread's where that is another object (vLLM's worker has no send
    thread where it does not put: ``kv_send_thread`` None)."""
    own = worker.store_replicate_config
    thread = worker.kv_send_thread
    return (own,) if thread is None or thread.replicate_config is own else (own, thread.replicate_config)


def store_segment(worker: Any) -> str:
    """The store segment ``worker``'s store mounted: this process's."""
    return str(worker.store.get_hostname())


# -- bench's baselines (vLLM itself, not this engine) ----------------------------------------
def version() -> str:
    """The installed vLLM's release (``vllm.__version__``); ImportError without vLLM."""
    import vllm

    return str(vllm.__version__)


def request_block_chain(tokens: Sequence[int], unit: int, algo: str) -> Callable[[], list[bytes]]:
    """vLLM's own block-hash chain over ``tokens``: a call of
    ``kv_cache_utils.get_request_block_hasher(unit, fn)`` (``fn`` is
    ``vllm.utils.hashing.<algo>``: ``sha256_cbor`` or ``xxhash_cbor``) on a ``Request``
    of them built once, without a hasher. vLLM's NONE_HASH is set first
    (``init_none_hash(fn)``, from the ``PYTHONHASHSEED`` the caller sets). bench's
    hashing baseline (``bench/vllm_chain.py``); ImportError without vLLM."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils import hashing
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    fn = {"sha256_cbor": hashing.sha256_cbor, "xxhash_cbor": hashing.xxhash_cbor}[algo]
    kv_cache_utils.init_none_hash(fn)
    hasher = kv_cache_utils.get_request_block_hasher(unit, fn)
    request = Request("bench-baseline", list(tokens), SamplingParams(max_tokens=1), None)
    return lambda: [bytes(h) for h in hasher(request)]


def run_cli(argv: Sequence[str]) -> None:
    """vLLM's command line (``vllm ARGV...``, e.g. ``serve``) in this process (``sys.argv``
    rebound): bench's ``vllm-pd`` baseline (``bench/vllm_pd.py``)."""
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()
