"""The router's Prometheus metrics (all ``hybridpd_`` prefixed), in one place."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from hybridpd.hashing import hashed_blocks
from hybridpd.prefix_outcomes import PREFIX_OUTCOMES
from services.worker.frames import REFUSALS

# Buckets that fit LLM latencies: 5 ms .. 2 min.
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hybridpd_requests", "Finished requests by API and status.", ["api", "status"], registry=r
        )
        self.ttft = Histogram("hybridpd_ttft_seconds", "Time to first token.", buckets=_LAT, registry=r)
        self.itl = Histogram(
            "hybridpd_inter_token_latency_seconds",
            "Time between streamed chunks.",
            buckets=sorted({*_FAST, 0.5, 1, 2.5}),
            registry=r,
        )
        self.e2e = Histogram(
            "hybridpd_e2e_latency_seconds", "Request latency, arrival to last token.", buckets=_LAT, registry=r
        )
        self.queue_time = Histogram(
            "hybridpd_queue_seconds",
            "Arrival until dispatch to prefill.",
            buckets=sorted({*_FAST, *_LAT}),
            registry=r,
        )
        self.ttft_stage = Histogram(
            "hybridpd_ttft_stage_seconds",
            "Time to first token by stage (with hybridpd_queue_seconds before them): prefill (on its actor, "
            "its queue included), prefill_call (the rest of the prefill call: actor hops, retries), decode "
            "(the prefill's result to the first decoded token: handoff, first step, stream; where decode "
            "samples the first token, as on vLLM).",
            ["stage"],
            buckets=sorted({*_FAST, *_LAT}),
            registry=r,
        )
        self.routing = Counter("hybridpd_routing_decisions", "Routing decisions by kind.", ["decision"], registry=r)
        self.decode_routing = Counter(
            "hybridpd_decode_routing_decisions",
            "Decode instance choices: affinity (the holder of the prompt's blocks), overloaded (the holder "
            "was too busy), round_robin (no holder, or one decode instance).",
            ["decision"],
            registry=r,
        )
        self.retries = Counter(
            "hybridpd_retries", "Work redone after a failure (prefill actor, handoff).", ["kind"], registry=r
        )
        self.prompt_tokens = Counter("hybridpd_prompt_tokens", "Prompt tokens received.", registry=r)
        self.cached_tokens = Counter("hybridpd_cached_tokens", "Prompt tokens restored from a cache.", registry=r)
        self.completion_tokens = Counter("hybridpd_completion_tokens", "Tokens generated.", registry=r)
        self.live_prefill = Gauge(
            "hybridpd_live_prefill_instances", "Prefill instances with a live heartbeat (last lookup).", registry=r
        )
        self.configured_prefill = Gauge(
            "hybridpd_configured_prefill_instances", "Prefill instances the router was started with.", registry=r
        )
        self.prefix_tokens = Counter(
            "hybridpd_prefix_tokens",
            "Prompt tokens of looked-up requests by why they were (not) restored: hit, checkpoint_missing"
            " (attention cached further than any usable state checkpoint), evicted (routed before, gone now),"
            " no_shared_prefix, eagle_replay (the unit an EAGLE hit replays on a prefill engine with a drafter:"
            " none of ours runs one),"
            " below_unit (no hit can cover them).",
            ["outcome"],
            registry=r,
        )
        for outcome in PREFIX_OUTCOMES:
            self.prefix_tokens.labels(outcome)
        self.index_promise_tokens = Counter(
            "hybridpd_index_promise_tokens",
            "Prompt tokens the prefix index promised on the instance a request was routed to (its local or the"
            " store's hit): kept (restored) or broken (promised but computed: the index claimed what the engine"
            " could not deliver).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("kept", "broken"):
            self.index_promise_tokens.labels(outcome)
        self.store_repairs = Counter(
            "hybridpd_index_store_repairs",
            "Store state entries dropped because a prefill restored less than they promised (vLLM engine: its"
            " store connector's evictions are never reported).",
            registry=r,
        )
        self.placed_checkpoints = Counter(
            "hybridpd_placed_checkpoints",
            "Checkpoint positions the router placed along prompts for a request that diverges from them first"
            " (checkpoint_placement; the engine writes those it can).",
            registry=r,
        )
        self.answer_checkpoints = Counter(
            "hybridpd_answer_checkpoints_requested",
            "Chat answers sent to their prefill instance to become part of the cached prefix.",
            registry=r,
        )
        self.answer_tokens = Counter(
            "hybridpd_answer_tokens",
            "Tokens of a previous answer in a chat prompt (recalled ids): restored (hit) or recomputed.",
            ["outcome"],
            registry=r,
        )
        self.answer_retokenized = Counter(
            "hybridpd_answer_retokenized",
            "Recalled answers whose text re-tokenizes to the generated ids (same) or not (differs).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("hit", "recomputed"):
            self.answer_tokens.labels(outcome)
        for outcome in ("same", "differs"):
            self.answer_retokenized.labels(outcome)
        self.index_lookup = Histogram(
            "hybridpd_index_lookup_seconds", "Prefix index lookup (one round trip).", buckets=_FAST, registry=r
        )
        self.index_lookups = Counter(
            "hybridpd_index_lookups",
            "Prefix index lookups answered, by the server that answered: primary, or replica"
            " (redis_read_replicas: stale by the replication lag).",
            ["source"],
            registry=r,
        )
        for source in ("primary", "replica"):
            self.index_lookups.labels(source)
        self.token_frames_refused = Counter(
            "hybridpd_token_frames_refused",
            "Token frames the router's sink refused, by reason: oversize (over max_token_frame_bytes), tag (not"
            " made with this deployment's key), version (another frame version or an unknown kind), malformed,"
            " sequence (replayed or out of order).",
            ["reason"],
            registry=r,
        )
        for reason in REFUSALS:
            self.token_frames_refused.labels(reason)
        r.register(_HashedBlocks())

    def token_frame_refused(self, reason: str) -> None:
        """The token sink refused a frame (``TokenSink``'s ``on_refused``)."""
        self.token_frames_refused.labels(reason).inc()


class _HashedBlocks(Collector):
    """``hybridpd_hashed_blocks_total``: the blocks this router process hashed
    (``hashing.hashed_blocks``): one chain per routed prompt, which travels with
    the request; the workers report theirs in ``/v1/hybridpd/stats``."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "hybridpd_hashed_blocks",
            "Prompt blocks (prefix_match_unit tokens) the router hashed into chain hashes: each prompt once,"
            " the chain travels to prefill and decode with the request.",
        )
        family.add_metric([], hashed_blocks())
        yield family
