"""Cache-event ingestion for ``bench index-scale``: a separate process applies
events through ``PrefixIndex.apply_local`` at a target rate while the main
process measures decisions (an event: one block stored or removed on one
instance; batches every 10 ms, like an actor's publisher)."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections.abc import Callable
from typing import Any

from bench.index_content import INSTANCES, NAMES
from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.hashing import BlockHash
from hybridpd.index.prefix_index import PrefixIndex

MODEL = "bench-scale"


def _ingest(url: str, rate: float, seconds: float, counter: Any, seed: int) -> None:
    """Apply ``rate`` events/s for ``seconds`` (batches every 10 ms; a window of 4,096
    blocks per instance: each stored block is removed later, so the index stays its size)."""
    index = PrefixIndex(url, MODEL, ttl_s=3600, heartbeat_ttl_s=3600, timeout_s=5.0)
    rng = random.Random(seed)
    window: list[list[bytes]] = [[] for _ in NAMES]
    t_end = time.perf_counter() + seconds
    sent = 0.0
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter()
        if now >= t_end:
            break
        due = int(rate * (now - t0) - sent) if rate > 0 else 2_000
        if due <= 0:
            time.sleep(0.002)
            continue
        due = min(due, 20_000)
        by_inst: dict[int, list[CacheEvent]] = {}
        for _ in range(due):
            i = rng.randrange(INSTANCES)
            w = window[i]
            if len(w) >= 4096 and rng.random() < 0.5:
                ev = CacheEvent(CacheEventKind.REMOVED, CacheGroup.KV, (BlockHash(w.pop(0)),))
            else:
                h = rng.randbytes(32)
                w.append(h)
                ev = CacheEvent(CacheEventKind.STORED, CacheGroup.KV, (BlockHash(h),))
            by_inst.setdefault(i, []).append(ev)
        for i, evs in by_inst.items():
            index.apply_local(NAMES[i], evs)
        sent += due
        with counter.get_lock():
            counter.value += due


def ingest_while(url: str, rate: float, seconds: float, seed: int) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)
    proc = ctx.Process(target=_ingest, args=(url, rate, seconds, counter, seed), daemon=True)
    proc.start()
    return proc, counter


def _started(counter: Any, timeout_s: float = 120.0) -> None:
    """Wait for the ingester's first batch (its start-up is not part of its rate), then 0.5 s more."""
    deadline = time.monotonic() + timeout_s
    while counter.value == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the ingester sent nothing in %.0f s" % timeout_s)
        time.sleep(0.05)
    time.sleep(0.5)


def ingestion(
    index: PrefixIndex, url: str, measure: Callable[[], dict[str, float]], rates: tuple[int, ...]
) -> dict[str, Any]:
    """``measure()`` (the 164K-token decisions) under each ingestion rate, and Redis CPU
    per event with the ingester alone."""
    rows = []
    for k, rate in enumerate(rates):
        proc, counter = ingest_while(url, rate, 3600.0, seed=k)
        _started(counter)
        c0, t0 = counter.value, time.perf_counter()
        got = measure()
        achieved = (counter.value - c0) / (time.perf_counter() - t0)
        proc.kill()
        proc.join()
        rows.append({"target_events_s": rate, "achieved_events_s": achieved, **got})
    # Redis CPU per event: the ingester alone, unthrottled, for 5 s
    proc, counter = ingest_while(url, 0, 6.0, seed=99)
    _started(counter)
    c0, cpu0, t0 = counter.value, redis_cpu_ms(index), time.perf_counter()
    proc.join()
    events = counter.value - c0
    cpu = redis_cpu_ms(index) - cpu0
    return {
        "ladder": rows,
        "alone_events_s": events / (time.perf_counter() - t0),
        "redis_cpu_us_per_event": cpu * 1e3 / max(events, 1),
    }


def redis_cpu_ms(index: PrefixIndex) -> float:
    """CPU time the Redis main thread has used (ms)."""
    info = index.r.info("cpu")
    return (float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])) * 1e3
