"""Actor metrics through ``ray.util.metrics`` (so they show in the Ray
dashboard and on Ray's Prometheus endpoint, where Ray prefixes them with
``ray_``: ``hybridpd_prefill_computed_tokens`` is scraped as
``ray_hybridpd_prefill_computed_tokens_total``).

Workers keep plain counters (cheap, lock-protected); a publisher thread turns
their growth into Ray counter increments and refreshes gauges once a second.
Latency histograms are observed where the work happens.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

logger = logging.getLogger(__name__)

# Buckets (seconds) that fit store, NIXL and prefill latencies.
LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
BYTE_BUCKETS = [float(1 << k) for k in range(12, 35, 2)]  # 4 KiB .. 16 GiB
ACCEPTANCE_BUCKETS = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0]


class ActorMetrics:
    """Counters named ``hybridpd_<name>`` with an ``instance`` tag."""

    def __init__(
        self,
        instance: str,
        counters: dict[str, str],
        gauges: dict[str, str],
        histograms: dict[str, tuple[str, list[float]]],
    ) -> None:
        from ray.util import metrics as m

        self.instance = instance
        tags = ("instance",)
        self.counters = {k: m.Counter("hybridpd_" + k, description=d, tag_keys=tags) for k, d in counters.items()}
        self.gauges = {k: m.Gauge("hybridpd_" + k, description=d, tag_keys=tags) for k, d in gauges.items()}
        self.histograms = {
            k: m.Histogram("hybridpd_" + k, description=d, boundaries=b, tag_keys=tags)
            for k, (d, b) in histograms.items()
        }
        self._last: dict[str, float] = {}
        self._tags = {"instance": instance}
        # NOTE: Ray's Counter.inc refuses 0, so a counter that never moved (checksum
        # failures, say) would be missing from scrapes, and dashboards and alerts
        # would see "no data" instead of 0. Record a zero delta once through the
        # metric's record path; if a Ray version lacks it, the series appears at
        # its first increment instead.
        for metric in self.counters.values():
            try:
                metric._record(0.0, tags=self._tags)
            except Exception:
                logger.debug("zero-initialising %s failed", metric, exc_info=True)

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value, tags=self._tags)

    def publish(self, counters: dict[str, float], gauges: dict[str, float]) -> None:
        for k, v in counters.items():
            metric = self.counters[k]  # an unknown name is a bug: KeyError, logged by run()
            delta = v - self._last.get(k, 0.0)
            if delta > 0:
                metric.inc(delta, tags=self._tags)
            self._last[k] = v
        for k, v in gauges.items():
            if k in self.gauges:
                self.gauges[k].set(v, tags=self._tags)

    def run(
        self,
        snapshot: Callable[[], tuple[dict[str, float], dict[str, float]]],
        stop: threading.Event,
        every_s: float = 1.0,
    ) -> threading.Thread:
        def loop() -> None:
            while not stop.wait(every_s):
                try:
                    self.publish(*snapshot())
                except Exception:  # metrics must never take an actor down
                    logger.warning("metrics publish failed", exc_info=True)

        t = threading.Thread(target=loop, name="metrics", daemon=True)
        t.start()
        return t


def _counter(help: str) -> Any:
    return field(default=0, metadata={"help": help})


@dataclass(slots=True)
class PrefillCounters:
    """A prefill worker's counters: each field is the metric ``hybridpd_<field>``,
    so a misspelt counter is a mypy error and, at run time, an AttributeError."""

    prefill_computed_tokens: int = _counter("Prompt tokens computed by prefill.")
    prefill_loaded_tokens: int = _counter("Prompt tokens restored from a cache (local or store).")
    prefill_store_loads: int = _counter("Checkpoints loaded from MooncakeStore.")
    prefill_store_load_failures: int = _counter("Store loads that failed (stale or corrupt): recomputed.")
    store_tag_failures: int = _counter(
        "Store objects whose checksum held but whose keyed tag failed (written without this deployment's key,"
        " or copied from another key): refused and deleted, the prompt recomputed."
    )
    checkpoint_exports: int = _counter("Checkpoints put in the store and published.")
    checkpoint_export_bytes: int = _counter("Bytes of checkpoints put in the store.")
    checkpoint_export_failures: int = _counter("Checkpoints that could not be stored or published.")
    checkpoint_state_bytes: int = _counter("State-checkpoint bytes put in the store (part of checkpoint_export_bytes).")
    placed_exports_skipped: int = _counter(
        "Placed (speculative) checkpoints not put in the store: larger than placement_share of its budget."
    )
    checkpoint_evictions: int = _counter(
        "State checkpoints this instance evicted from the store by value (index entry first, then the object)."
    )
    answer_checkpoints: int = _counter("Answer checkpoints written (prompt + answer prefilled at low priority).")
    answer_checkpoint_tokens: int = _counter("Tokens computed for answer checkpoints (the answers, mostly).")
    answer_checkpoint_bytes: int = _counter("Bytes of answer checkpoints put in the store.")
    answer_checkpoints_dropped: int = _counter("Answer checkpoints dropped: too many waiting on this instance.")
    answer_checkpoints_skipped: int = _counter(
        "Answer checkpoints not made: the engine cannot (vLLM), or the prompt's checkpoint is gone here."
    )
    answer_checkpoints_failed: int = _counter("Answer checkpoints that failed (a later hit is lost, nothing else).")
    handoff_offered_bytes: int = _counter("Bytes offered to decode over NIXL.")
    handoffs_expired: int = _counter("Handoffs freed by timeout (decode never read them).")
    store_get_bytes: int = _counter("Bytes of checkpoints loaded from MooncakeStore.")
    cache_events_published: int = _counter("Local cache changes (stored / removed / cleared) written to the index.")
    cache_events_dropped: int = _counter("Local cache changes the index did not take (unavailable).")


@dataclass(slots=True)
class DecodeCounters:
    """A decode worker's counters (see :class:`PrefillCounters`)."""

    decode_tokens: int = _counter("Tokens generated by decode.")
    decode_handoffs: int = _counter("Handoffs decode continued (prefilled elsewhere).")
    kv_waits: int = _counter("Handoffs that waited for free KV blocks before they could continue.")
    eagle_steps: int = _counter("EAGLE verification steps.")
    eagle_emitted_tokens: int = _counter("Tokens emitted by EAGLE verification steps.")
    nixl_read_bytes: int = _counter("Bytes read from prefill over NIXL.")
    handoff_skipped_bytes: int = _counter(
        "Handoff bytes not read: KV blocks this instance's prefix cache held (delta handoffs)."
    )
    delta_handoffs: int = _counter("Handoffs that read only the blocks this instance lacked (held at least one).")
    checksum_failures: int = _counter("Handoffs whose checksum failed (never used).")
    handoff_tag_failures: int = _counter(
        "Handoffs whose descriptor failed its keyed tag (not offered with this deployment's key): never read."
    )
    cache_events_published: int = _counter("Local cache changes (stored / removed / cleared) written to the index.")
    cache_events_dropped: int = _counter("Local cache changes the index did not take (unavailable).")


def counter_help(cls: type) -> dict[str, str]:
    """``{metric name: help}`` of a counters dataclass."""
    return {f.name: f.metadata["help"] for f in fields(cls)}


PREFILL_COUNTERS = counter_help(PrefillCounters)
PREFILL_GAUGES = {
    "prefill_queued_tokens": "Prompt tokens waiting in this instance.",
    "prefill_running_requests": "Requests prefilling in this instance.",
    "free_kv_blocks": "Free KV blocks in this instance's pool.",
    "store_state_bytes": "State-checkpoint bytes this instance holds in the store now (at most store_state_budget_mb).",
}
PREFILL_HISTOGRAMS = {
    "answer_publish_seconds": (
        "From a finished answer reaching its prefill instance to its checkpoint in the index.",
        LATENCY_BUCKETS,
    ),
    "store_put_seconds": ("Time to put one checkpoint in MooncakeStore.", LATENCY_BUCKETS),
    "store_get_seconds": ("Time to load one checkpoint from MooncakeStore.", LATENCY_BUCKETS),
    "prefill_seconds": ("Time to prefill one request (queue included).", LATENCY_BUCKETS),
    "handoff_seconds": ("Time from offering a handoff to decode releasing it.", LATENCY_BUCKETS),
}
DECODE_COUNTERS = counter_help(DecodeCounters)
DECODE_GAUGES = {
    "decode_running_requests": "Requests decoding in this instance.",
    "free_kv_blocks": "Free KV blocks in this instance's pool.",
}
DECODE_HISTOGRAMS = {
    "nixl_read_seconds": ("Time to read and verify one handoff over NIXL.", LATENCY_BUCKETS),
    "handoff_bytes": ("Bytes one handoff read over NIXL (a delta handoff: only what decode lacked).", BYTE_BUCKETS),
    "eagle_acceptance_length": ("Tokens emitted per EAGLE step (mean over a request).", ACCEPTANCE_BUCKETS),
}
