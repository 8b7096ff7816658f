"""The global prefix index at cluster scale: a real redis-server and the real
``lookup.lua``, 64 prefill instances, up to 10M block memberships.

Content (``Population``): synthetic but shaped like traffic, in rounds of
one system prompt (32 blocks, held by 48 of the instances and the store),
eight agent trees (a 16-block trunk on 8 instances, four 16-block branches on
2 each, all in the store) and twenty long unique tails (log-uniform 8-1,281
blocks, one instance each, half of them in the store). Every holder also keeps
a state checkpoint every 16 blocks and at the end of each segment (the state
memberships). A *membership* is one field of an instance hash (a KV block or a
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
per instance, 32-byte members), the hashes used until 2026-12 (a field per
block with the value ``1``), today's sets with members cut to 16 bytes (not
exact: shown for scale), and one string key per block holding a 64-bit bitmap
of its holders.

``markdown(out)`` renders the README tables from the JSON.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import repeats as repeats_mod
from bench.report import spread, write_json
from bench.router import budget_check, checks_markdown, fmt_range, repeats_phrase
from hybridpd.engine.base import CacheEvent, CacheEventKind, CacheGroup
from hybridpd.hashing import BlockHash, BlockHasher
from hybridpd.index.prefix_index import InstanceLoad, PrefixIndex
from hybridpd.index.redis_server import RedisServer
from services.router.routing import choose

log = logging.getLogger(__name__)

MODEL = "bench-scale"
SEED = "bench"
INSTANCES = 64
NAMES = ["prefill-%02d" % i for i in range(INSTANCES)]
SIZES = (1_024, 16_384, 164_000)
PROBES = 4
STATE_EVERY = 16
#: the done-when bound: the 164K-token decision p99 at the top level over its value at the lowest
GROWTH_BUDGET = 2.0
#: today's encoding first, then the alternatives measured beside it
ENCODINGS = ("set_per_instance", "hash_per_instance", "set_per_instance_16B", "bitmap_per_block")
FULL_LEVELS = (100_000, 1_000_000, 3_000_000, 10_000_000)
QUICK_LEVELS = (100_000, 300_000, 1_000_000)
FULL_RATES = (10_000, 30_000, 100_000)
QUICK_RATES = (5_000, 20_000, 50_000)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- content ---------------------------------------------------------------------------
@dataclass(slots=True)
class Segment:
    """``n`` consecutive blocks held by ``holders`` (instance indices), in the store or not."""

    hashes: list[bytes]
    holders: list[int]
    store: bool

    def states(self) -> list[bytes]:
        """The blocks a holder keeps a state at: every STATE_EVERY-th and the last."""
        n = len(self.hashes)
        return [self.hashes[i - 1] for i in range(1, n + 1) if i % STATE_EVERY == 0 or i == n]


@dataclass(slots=True)
class Population:
    """The synthetic content, generated deterministically and counted as it goes."""

    seed: int
    memberships: int = 0
    store_entries: int = 0
    blocks: int = 0
    by_kind: dict[str, int] = field(default_factory=lambda: {"system": 0, "tree": 0, "tail": 0})
    _rng: random.Random = field(init=False)
    _queue: list[tuple[str, Segment]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def _hashes(self, n: int) -> list[bytes]:
        raw = self._rng.randbytes(32 * n)
        return [raw[i : i + 32] for i in range(0, 32 * n, 32)]

    def _round(self) -> list[tuple[str, Segment]]:
        rng = self._rng
        out = [("system", Segment(self._hashes(32), rng.sample(range(INSTANCES), 48), True))]
        for _ in range(8):
            out.append(("tree", Segment(self._hashes(16), rng.sample(range(INSTANCES), 8), True)))
            out += [("tree", Segment(self._hashes(16), rng.sample(range(INSTANCES), 2), True)) for _ in range(4)]
        for k in range(20):
            n = int(math.exp(rng.uniform(math.log(8), math.log(1281))))
            out.append(("tail", Segment(self._hashes(n), [rng.randrange(INSTANCES)], k % 2 == 0)))
        return out

    def until(self, memberships: int) -> Iterator[Segment]:
        """Segments until the count reaches ``memberships`` (counted as yielded)."""
        while self.memberships < memberships:
            if not self._queue:
                self._queue = self._round()
            kind, seg = self._queue.pop(0)
            m = (len(seg.hashes) + len(seg.states())) * len(seg.holders)
            self.memberships += m
            self.by_kind[kind] += m
            self.blocks += len(seg.hashes)
            if seg.store:
                self.store_entries += len(seg.hashes) + len(seg.states())
            yield seg


# -- loading: RESP packed by hand (redis-py's generic packing would dominate) --------------
def _bulk(x: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(x), x)


def _cmd(*args: bytes) -> bytes:
    return b"*%d\r\n%s" % (len(args), b"".join(map(_bulk, args)))


def _hset(key: bytes, fields: list[bytes], value: bytes = b"1") -> bytes:
    v = _bulk(value)
    return b"*%d\r\n%s%s%s" % (2 + 2 * len(fields), _bulk(b"HSET"), _bulk(key), b"".join(_bulk(f) + v for f in fields))


class Loader:
    """Pipelined raw commands on one connection, flushed every ~1 MB."""

    def __init__(self, index: PrefixIndex) -> None:
        self.conn = index.r.connection_pool.get_connection()
        self.buf: list[bytes] = []
        self.size = 0

    def add(self, packed: bytes) -> None:
        self.buf.append(packed)
        self.size += len(packed)
        if self.size > 1 << 20:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        self.conn.send_packed_command(self.buf)
        for _ in self.buf:
            self.conn.read_response()  # raises on an error reply
        self.buf, self.size = [], 0


def load_today(loader: Loader, keys: Any, segments: Iterator[Segment], ttl_s: int, member_bytes: int = 32) -> None:
    """Today's encoding (schema.py): a set per instance, a key per store entry."""
    ttl = b"%d" % ttl_s
    for seg in segments:
        kv = [h[:member_bytes] for h in seg.hashes]
        st = [h[:member_bytes] for h in seg.states()]
        for i in seg.holders:
            loader.add(_cmd(b"SADD", keys.local_kv(NAMES[i]).encode(), *kv))
            loader.add(_cmd(b"SADD", keys.local_st(NAMES[i]).encode(), *st))
        if seg.store:
            for h in seg.hashes:
                loader.add(_cmd(b"SET", keys.kv(BlockHash(h)), b"1", b"EX", ttl))
            for pos, h in enumerate(seg.states()):
                loader.add(_cmd(b"SET", keys.st(BlockHash(h)), b"%d" % pos, b"EX", ttl))
    loader.flush()


def load_hashes(loader: Loader, keys: Any, segments: Iterator[Segment]) -> None:
    """The encoding until 2026-12: a hash per instance, each field's value ``1``."""
    for seg in segments:
        for i in seg.holders:
            loader.add(_hset(keys.local_kv(NAMES[i]).encode(), seg.hashes))
            loader.add(_hset(keys.local_st(NAMES[i]).encode(), seg.states()))
    loader.flush()


def load_bitmap(loader: Loader, prefix: bytes, segments: Iterator[Segment], ttl_s: int) -> None:
    """The alternative: one string key per block (and per state) holding a 64-bit bitmap
    of its holders; the store's entries as today."""
    ttl = b"%d" % ttl_s
    for seg in segments:
        bits = sum(1 << i for i in seg.holders).to_bytes(8, "little")
        for h in seg.hashes:
            loader.add(_cmd(b"SET", prefix + b"b:" + h, bits))
        for h in seg.states():
            loader.add(_cmd(b"SET", prefix + b"sb:" + h, bits))
        if seg.store:
            for h in seg.hashes:
                loader.add(_cmd(b"SET", prefix + b"kv:" + h, b"1", b"EX", ttl))
            for pos, h in enumerate(seg.states()):
                loader.add(_cmd(b"SET", prefix + b"st:" + h, b"%d" % pos, b"EX", ttl))
    loader.flush()


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
        index.heartbeat(name, InstanceLoad())


def redis_cpu_ms(index: PrefixIndex) -> float:
    info = index.r.info("cpu")
    return (float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])) * 1e3


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


# -- ingestion ---------------------------------------------------------------------------------
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


def ingest_while(url: str, rate: float, seconds: float, seed: int) -> tuple[mp.Process, Any]:
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
    index: PrefixIndex,
    url: str,
    hasher: BlockHasher,
    probes: list[Probe],
    unit: int,
    iterations: int,
    rates: tuple[int, ...],
) -> dict[str, Any]:
    """The 164K-token decision under each ingestion rate, and Redis CPU per event alone."""
    rows = []
    for k, rate in enumerate(rates):
        proc, counter = ingest_while(url, rate, 3600.0, seed=k)
        _started(counter)
        c0, t0 = counter.value, time.perf_counter()
        got = decisions(index, hasher, probes, unit, iterations, check=False)
        achieved = (counter.value - c0) / (time.perf_counter() - t0)
        proc.kill()
        proc.join()
        heartbeat_all(index)
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
            top = ingestion(index, srv.url, hasher, probes[SIZES[-1]], unit, iterations, rates)
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


def plot(path: Path, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lv = out["levels"]
    xs = [v["memberships"] for v in lv.values()]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for n in out["sizes"]:
        key = "tokens_%d" % n
        axes[0].plot(xs, [v[key]["p99_ms"] for v in lv.values()], marker="o", label="%dK p99" % (n // 1000))
        axes[0].plot(xs, [v[key]["p50_ms"] for v in lv.values()], marker=".", ls="--", label="%dK p50" % (n // 1000))
    axes[0].set_xscale("log")
    axes[0].set_xlabel("memberships")
    axes[0].set_ylabel("decision ms")
    axes[0].set_title("decision latency vs index size", fontsize=10)
    axes[0].legend(fontsize=7)
    axes[1].plot(xs, [v["bytes_per_membership"] for v in lv.values()], marker="o", label="per membership")
    axes[1].plot(xs, [v["bytes_per_store_entry"] for v in lv.values()], marker="o", label="per store entry")
    axes[1].set_xscale("log")
    axes[1].set_ylabel("Redis bytes")
    axes[1].set_title("memory", fontsize=10)
    axes[1].legend(fontsize=7)
    lad = out["ingestion"]["ladder"]
    axes[2].plot([r["achieved_events_s"] for r in lad], [r["p99_ms"] for r in lad], marker="o", label="p99")
    axes[2].axhline(out["ingestion"]["budget_ms"], color="red", ls=":", label="budget")
    axes[2].set_xlabel("events/s ingested")
    axes[2].set_ylabel("164K decision ms")
    axes[2].set_title("decision under ingestion (top level)", fontsize=10)
    axes[2].legend(fontsize=7)
    fig.suptitle(
        "index at scale, %d instances, unit %d, median of %d repeats"
        % (out["instances"], out["unit"], out["repeat_count"]),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(out: dict[str, Any]) -> str:
    """The README tables of a ``run`` result."""
    sizes = out["sizes"]
    rows = [
        "%s; %d live prefill instances; unit %d; %d decisions per size and level (hash chain + one"
        " `lookup.lua` + choice). Content by membership share: %s."
        % (
            repeats_phrase(out["repeat_count"]),
            out["instances"],
            out["unit"],
            out["iterations"],
            ", ".join("%s %.0f%%" % (k, 100 * v) for k, v in out["content"].items()),
        ),
        "",
        "| memberships | store entries | Redis MiB | B / membership | B / store entry | "
        + " | ".join("%dK p50 / p99 ms" % (n // 1000) for n in sizes)
        + " | Redis CPU / 164K lookup ms |",
        "|---|---|---|---|---|" + "---|" * len(sizes) + "---|",
    ]
    for key, v in out["levels"].items():
        cells = [
            "{:,}".format(v["memberships"]),
            "{:,}".format(v["store_entries"]),
            spread(out, "levels", key, "used_memory_mb", spec="%.0f"),
            spread(out, "levels", key, "bytes_per_membership", spec="%.0f"),
            spread(out, "levels", key, "bytes_per_store_entry", spec="%.0f"),
        ]
        for n in sizes:
            t = "tokens_%d" % n
            cells.append(
                "%s / %s"
                % (
                    spread(out, "levels", key, t, "p50_ms", spec="%.2f"),
                    spread(out, "levels", key, t, "p99_ms", spec="%.2f"),
                )
            )
        cells.append(spread(out, "levels", key, "tokens_%d" % sizes[-1], "redis_cpu_ms_per_lookup", spec="%.2f"))
        rows.append("| " + " | ".join(cells) + " |")
    ing = out["ingestion"]
    rows += [
        "",
        "Ingestion at the top level (an event: one block stored or removed on one instance, through"
        " `PrefixIndex.apply_local`); budget: the 164K decision p99 <= %.1fx its idle value (%s ms)."
        % (
            out["budget_factor"],
            fmt_range(ing["budget_ms"], out["min"]["ingestion"]["budget_ms"], out["max"]["ingestion"]["budget_ms"]),
        ),
        "",
        "| target events/s | achieved events/s | 164K decision p50 ms | p99 ms |",
        "|---|---|---|---|",
    ]
    for i, r in enumerate(ing["ladder"]):
        rows.append(
            "| {:,} | {} | {} | {} |".format(
                r["target_events_s"],
                spread(out, "ingestion", "ladder", i, "achieved_events_s", spec="%.0f"),
                spread(out, "ingestion", "ladder", i, "p50_ms", spec="%.2f"),
                spread(out, "ingestion", "ladder", i, "p99_ms", spec="%.2f"),
            )
        )
    rows += [
        "",
        "Sustained within budget: %s events/s. Ingester alone: %s events/s, Redis CPU %s us per event."
        % (
            spread(out, "ingestion", "sustained_events_s", spec="%.0f"),
            spread(out, "ingestion", "alone_events_s", spec="%.0f"),
            spread(out, "ingestion", "redis_cpu_us_per_event", spec="%.2f"),
        ),
        "",
        "Encodings, the same content at {:,} memberships:".format(out["encoding_level"]),
        "",
        "| encoding | Redis keys | B / membership |",
        "|---|---|---|",
    ]
    for name, e in out["encodings"].items():
        rows.append(
            "| %s | {:,} | %s |".format(e["keys"])
            % (name, spread(out, "encodings", name, "bytes_per_membership", spec="%.1f"))
        )
    names = {"growth_p99_%d" % sizes[-1]: "164K decision p99, top level / lowest level"}
    rows += ["", *checks_markdown(out["checks"], names, spec="%.2f")]
    return "\n".join(rows) + "\n"
