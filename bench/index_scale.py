"""The global prefix index at cluster scale: a real redis-server and the real
``lookup.lua``, 64 prefill instances, up to 10M block memberships.

Content (``Population``): synthetic but shaped like traffic, in rounds of
one system prompt (32 blocks, held by 48 of the instances and the store),
eight agent trees (a 16-block trunk on 8 instances, four 16-block branches on
2 each, all in the store) and twenty long unique tails (log-uniform 8-1,281
blocks, one instance each, half of them in the store). Every holder also keeps
a state checkpoint every 16 blocks and at the end of each segment (the state
memberships). A *membership* is one member of an instance set (a KV block or a
state held by one instance); the store's entries (one key per block or state)
are counted beside them. Hashes are random 32-byte digests, as sha256_cbor's
are to Redis.

Probes: per prompt size (1K / 16K / 164K tokens at unit 128) four prompts
whose chains are hashed from tokens (``BlockHasher``, as the router does)
and placed so the lookup does a realistic scan: 90 % of the chain on one
instance, 50 % on seven, the first 32 blocks on forty, nothing on the last
sixteen, 80 % in the store, a state at each end. Every probe's first lookup is
checked against the placement, so a wrong answer fails the run.

One repeat, on a fresh redis-server: for each level (memberships 100K ... 10M,
filled incrementally) the decision (hash chain + one lookup over 64 live
instances + ``choose``) p50/p99 per size, the Redis main thread's CPU per
lookup (``INFO cpu``), and Redis' memory per membership and per store entry
(``used_memory`` deltas). At the top level, ingestion: a second process
applies cache events through ``PrefixIndex.apply_local`` (an event: one block
stored or removed on one instance, flushed in batches every 10 ms like an
actor's publisher) at each rate of a ladder while the 164K-token decision is
measured; the sustained rate is the highest achieved rate whose decision p99
stays within ``budget_factor`` x the idle p99. Redis CPU per event is measured
with the ingester alone.

Encodings (item 2 of #30): the same content at ``encoding_level`` is loaded
into fresh servers in each encoding and their memory compared: today's (a set
per instance, 32-byte members), a hash per instance (a field per block with
the value ``1``, the encoding the sets replaced), today's sets with members cut to 16 bytes (not
exact: shown for scale), and one string key per block holding a 64-bit bitmap
of its holders.

``markdown(out)`` renders the README tables from the JSON.
"""

from __future__ import annotations

import logging
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import repeats as repeats_mod
from bench.index_content import (
    ENCODINGS,
    INSTANCES,
    NAMES,
    Loader,
    Population,
    Segment,
    load_bitmap,
    load_hashes,
    load_today,
)
from bench.index_ingest import MODEL, ingestion, redis_cpu_ms
from bench.index_scale_report import markdown, plot
from bench.report import write_json
from bench.router import budget_check
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from services.router.routing import choose

__all__ = ["ENCODINGS", "NAMES", "markdown", "run"]

log = logging.getLogger(__name__)

SEED = "bench"
SIZES = (1_024, 16_384, 164_000)
PROBES = 4
#: the done-when bound: the 164K-token decision p99 at the top level over its value at the lowest
GROWTH_BUDGET = 2.0
FULL_LEVELS = (100_000, 1_000_000, 3_000_000, 10_000_000)
QUICK_LEVELS = (100_000, 300_000, 1_000_000)
FULL_RATES = (10_000, 30_000, 100_000)
QUICK_RATES = (5_000, 20_000, 50_000)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- probes ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Probe:
    tokens: list[int]
    expected_store: int
    expected: dict[str, int]


def place_probes(index: PrefixIndex, hasher: BlockHasher, n: int, unit: int) -> list[Probe]:
    """``PROBES`` prompts of ``n`` tokens, placed as the module doc says; their expected hits."""
    rng = random.Random(n)
    out = []
    for p in range(PROBES):
        tokens = [rng.randrange(0, 150_000) for _ in range(n)]
        chain = hasher.chain(tokens)
        cap = (n - 1) // unit
        placement = [(0, 0.9)] + [(i, 0.5) for i in range(1, 8)] + [(i, -32.0) for i in range(8, 48)]
        expected = dict.fromkeys(NAMES, 0)
        for i, frac in placement:
            m = min(32, len(chain)) if frac < 0 else max(1, int(len(chain) * frac))
            index.publish_local(NAMES[i], chain[:m], [chain[m - 1]])
            expected[NAMES[i]] = min(m, cap) * unit if m <= cap else 0
        k = max(1, int(len(chain) * 0.8))
        index.publish_store(chain[:k], chain[k - 1], k * unit)
        out.append(Probe(tokens, (k * unit if k <= cap else 0), expected))
        del p
    return out


def heartbeat_all(index: PrefixIndex) -> None:
    for name in NAMES:
        index.heartbeat(name)


def used_memory(index: PrefixIndex) -> int:
    return int(index.r.info("memory")["used_memory"])


def decisions(
    index: PrefixIndex, hasher: BlockHasher, probes: list[Probe], unit: int, iterations: int, check: bool
) -> dict[str, float]:
    """``iterations`` decisions over the probes in turn: wall p50/p99 (ms), Redis CPU per lookup."""
    n = len(probes[0].tokens)
    queued = dict.fromkeys(NAMES, 0.0)
    if check:
        for p in probes:
            res = index.lookup(hasher.chain(p.tokens), n, unit, False)
            got = {k: res.instance_hits.get(k, 0) for k in NAMES}
            if res.store_hit != p.expected_store or got != p.expected:
                bad = {k: (got[k], p.expected[k]) for k in NAMES if got[k] != p.expected[k]}
                raise AssertionError(
                    "lookup differs from the placement: store %d vs %d, instances %s"
                    % (res.store_hit, p.expected_store, bad)
                )
    lat, lookup_ms = [], []
    cpu0 = redis_cpu_ms(index)
    for i in range(iterations):
        p = probes[i % len(probes)]
        t0 = time.perf_counter()
        chain = hasher.chain(p.tokens)
        t1 = time.perf_counter()
        res = index.lookup(chain, n, unit, False)
        t2 = time.perf_counter()
        choose(n, NAMES, res.instance_hits, res.store_hit, queued)
        t3 = time.perf_counter()
        lat.append((t3 - t0) * 1e3)
        lookup_ms.append((t2 - t1) * 1e3)
    cpu = (redis_cpu_ms(index) - cpu0) / iterations
    return {
        "p50_ms": statistics.median(lat),
        "p99_ms": _pct(lat, 0.99),
        "lookup_p50_ms": statistics.median(lookup_ms),
        "lookup_p99_ms": _pct(lookup_ms, 0.99),
        "redis_cpu_ms_per_lookup": cpu,
    }


# -- one repeat ---------------------------------------------------------------------------------
def _fresh(tmp: Path) -> tuple[RedisServer, PrefixIndex]:
    srv = RedisServer(tmp)
    srv.start()
    return srv, PrefixIndex(srv.url, MODEL, ttl_s=3600, heartbeat_ttl_s=3600, timeout_s=30.0)


def _repeat(
    levels: tuple[int, ...],
    rates: tuple[int, ...],
    unit: int,
    iterations: int,
    encoding_level: int,
    budget_factor: float,
) -> dict[str, Any]:
    hasher = BlockHasher(unit=unit, seed=SEED)
    out: dict[str, Any] = {"levels": {}}
    with tempfile.TemporaryDirectory() as tmp:
        srv, index = _fresh(Path(tmp))
        try:
            empty = used_memory(index)
            probes = {n: place_probes(index, hasher, n, unit) for n in SIZES}
            base = used_memory(index)
            pop = Population(seed=1)
            loader = Loader(index)
            mem_local = mem_store = 0
            for level in tqdm(levels, desc="levels", leave=False):
                # local memberships first, then the store's entries, each measured by its own delta
                segs = list(pop.until(level))
                m0 = used_memory(index)
                load_today(loader, index.keys, iter([Segment(s.hashes, s.holders, False) for s in segs]), 3600)
                m1 = used_memory(index)
                load_today(loader, index.keys, iter([Segment(s.hashes, [], s.store) for s in segs]), 3600)
                m2 = used_memory(index)
                mem_local += m1 - m0
                mem_store += m2 - m1
                heartbeat_all(index)
                sizes = {
                    "tokens_%d" % n: decisions(index, hasher, probes[n], unit, iterations, check=True) for n in SIZES
                }
                out["levels"]["m_%d" % level] = {
                    "memberships": pop.memberships,
                    "store_entries": pop.store_entries,
                    "blocks": pop.blocks,
                    "used_memory_mb": (m2 - empty) / 2**20,
                    "bytes_per_membership": mem_local / pop.memberships,
                    "bytes_per_store_entry": mem_store / max(pop.store_entries, 1),
                    **sizes,
                }
            out["content"] = {k: v / pop.memberships for k, v in pop.by_kind.items()}
            out["probes_memory_mb"] = (base - empty) / 2**20
            top = ingestion(
                index,
                srv.url,
                lambda: decisions(index, hasher, probes[SIZES[-1]], unit, iterations, check=False),
                rates,
            )
        finally:
            srv.stop()
    first, last = out["levels"]["m_%d" % levels[0]], out["levels"]["m_%d" % levels[-1]]
    key = "tokens_%d" % SIZES[-1]
    out["growth_p99_%d" % SIZES[-1]] = last[key]["p99_ms"] / first[key]["p99_ms"]
    out["growth_lookup_p99_%d" % SIZES[-1]] = last[key]["lookup_p99_ms"] / first[key]["lookup_p99_ms"]
    budget = budget_factor * last[key]["p99_ms"]
    ok = [r["achieved_events_s"] for r in top["ladder"] if r["p99_ms"] <= budget]
    out["ingestion"] = {**top, "budget_ms": budget, "sustained_events_s": max(ok) if ok else 0.0}
    out["encodings"] = encodings(encoding_level)
    return out


def encodings(level: int) -> dict[str, Any]:
    """Bytes per membership of the same content in today's encoding and two alternatives."""
    out = {}
    for name in ENCODINGS:
        with tempfile.TemporaryDirectory() as tmp:
            srv, index = _fresh(Path(tmp))
            try:
                pop = Population(seed=1)
                loader = Loader(index)
                segs = list(pop.until(level))
                m0 = used_memory(index)
                local = iter([Segment(s.hashes, s.holders, False) for s in segs])
                if name == "bitmap_per_block":
                    load_bitmap(loader, index.keys.prefix.encode(), local, 3600)
                elif name == "hash_per_instance":
                    load_hashes(loader, index.keys, local)
                else:
                    load_today(loader, index.keys, local, 3600, member_bytes=16 if name.endswith("16B") else 32)
                out[name] = {
                    "memberships": pop.memberships,
                    "keys": int(index.r.dbsize()),
                    "bytes_per_membership": (used_memory(index) - m0) / pop.memberships,
                }
            finally:
                srv.stop()
    return out


def run(
    json_path: Path,
    quick: bool = False,
    repeats: int = 3,
    levels: tuple[int, ...] | None = None,
    rates: tuple[int, ...] | None = None,
    unit: int = 128,
    iterations: int = 200,
    budget_factor: float = 2.0,
) -> dict[str, Any]:
    """Measure ``repeats`` times; write JSON, PNG and markdown beside ``json_path``."""
    levels = tuple(sorted(levels or (QUICK_LEVELS if quick else FULL_LEVELS)))
    rates = tuple(rates or (QUICK_RATES if quick else FULL_RATES))
    encoding_level = min(levels[-1], 1_000_000)
    measured = repeats_mod.measure(
        lambda: _repeat(levels, rates, unit, iterations, encoding_level, budget_factor), repeats, "index-scale"
    )
    key = "growth_p99_%d" % SIZES[-1]
    out = {
        "quick": quick,
        "instances": INSTANCES,
        "unit": unit,
        "sizes": list(SIZES),
        "iterations": iterations,
        "rates": list(rates),
        "budget_factor": budget_factor,
        "encoding_level": encoding_level,
        **measured,
        "checks": {key: budget_check([r[key] for r in measured["repeats"]], GROWTH_BUDGET)},
    }
    write_json(json_path, out)
    plot(json_path.with_suffix(".png"), out)
    json_path.with_suffix(".md").write_text(markdown(out))
    return out
