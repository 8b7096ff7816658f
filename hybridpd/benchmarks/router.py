"""Router decision latency: hash chain + ONE index lookup + routing choice.

Tokenization is excluded. A real redis-server holds a realistic index: the
store has the first 80 % of the chain with a state checkpoint at its end, and
two live prefill instances hold the first 40 % / 60 % locally.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hybridpd.benchmarks.report import write_report
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import InstanceLoad, PrefixIndex
from hybridpd.index.redis_server import RedisServer
from services.router.routing import choose


def run(json_path: Path, iterations: int = 300, unit: int = 128) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        srv = RedisServer(Path(tmp))
        srv.start()
        try:
            for n in (16_384, 164_000):
                index = PrefixIndex(srv.url, "bench-router-%d" % n)
                hasher = BlockHasher(unit=unit, seed="bench")
                rng = random.Random(n)
                tokens = [rng.randrange(0, 150_000) for _ in range(n)]
                chain = hasher.chain(tokens)
                k = int(len(chain) * 0.8)
                index.publish_store(chain[:k], chain[k - 1], k * unit)
                for i, frac in enumerate((0.4, 0.6)):
                    m = int(len(chain) * frac)
                    index.publish_local("prefill-%d" % i, chain[:m], [chain[m - 1]])
                    index.heartbeat("prefill-%d" % i, InstanceLoad())
                lat = []
                for _ in tqdm(range(iterations), desc="%d tokens" % n, leave=False):
                    t0 = time.perf_counter()
                    h = hasher.chain(tokens)
                    res = index.lookup(h, n, unit, False)
                    d = choose(n, ["prefill-0", "prefill-1"], res.instance_hits, res.store_hit, {})
                    lat.append((time.perf_counter() - t0) * 1e3)
                assert res.store_hit == k * unit and d.kind == "store_hit"
                lat.sort()
                results["tokens_%d" % n] = {
                    "blocks": len(chain),
                    "p50_ms": statistics.median(lat),
                    "p99_ms": lat[int(0.99 * len(lat))],
                }
        finally:
            srv.stop()
    out = {"unit": unit, "iterations": iterations, "results": results}
    write_report(
        json_path,
        out,
        {k: v["p50_ms"] for k, v in results.items()},
        "ms (p50)",
        "Router decision: hash + index lookup + choose",
    )
    return out
