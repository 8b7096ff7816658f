"""State plane speed: index lookup latency, store and NIXL throughput.

    python -m bench.state_plane [--quick] [--json bench/results/state_plane.json]

Starts a real redis-server and mooncake_master on loopback. Measures:
- index lookup p50/p99 for a 1,300-hash chain (164K tokens at unit 128) with
  2 live instances, beside a plain Redis PING round trip;
- store put/get GB/s of one object, beside a memcpy of the same bytes;
- NIXL READ GB/s between two processes (decode here, prefill in a child),
  beside a memcpy of the same bytes.

Every throughput is timed ``--repeats`` times (default 5); the JSON keeps each
repeat and reports the median with min and max (``bench.repeats.summary``);
the ratios to memcpy are of the medians. The run's provenance is recorded.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench import provenance
from bench.repeats import summary
from bench.report import write_report
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from hybridpd.store.client import CheckpointStore
from hybridpd.store.master import MooncakeMaster
from services.worker.api import prefill_name


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def _memcpy_gbps(nbytes: int, repeat: int) -> dict[str, Any]:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return summary([nbytes / _timed(lambda: dst.copy_(src)) / 1e9 for _ in range(repeat)])


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _nixl_server(nbytes: int, q_out: Any, q_in: Any) -> None:
    from hybridpd.transfer.nixl_handoff import HandoffServer

    server = HandoffServer("bench-prefill", timeout_s=600)
    for _ in range(q_in.get()):
        q_out.put(server.offer([torch.ones(nbytes, dtype=torch.uint8)]))
    q_in.get()
    server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=Path("bench/results/state_plane.json"))
    ap.add_argument("--repeats", type=int, default=5, help="timings per throughput; medians are published")
    args = ap.parse_args()
    with provenance.record() as prov:
        result = measure(args.quick, args.repeats)
    result["provenance"] = prov.to_dict()
    print(result)
    write_report(
        args.json,
        result,
        {
            "store put": result["store"]["put_gbps"]["median"],
            "store get": result["store"]["get_gbps"]["median"],
            "nixl read": result["nixl"]["read_gbps_incl_verify"]["median"],
            "memcpy": result["store"]["memcpy_gbps"]["median"],
        },
        "GB/s (median)",
        "State plane throughput (loopback, 2-core CPU)",
    )
    print("wrote %s" % args.json)


def measure(quick: bool, repeats: int) -> dict[str, Any]:
    """One run of every measurement (each throughput timed ``repeats`` times)."""
    n_lookups = 100 if quick else 1000
    nbytes = (16 if quick else 64) << 20
    result: dict[str, Any] = {"quick": quick, "repeats": repeats}
    with tempfile.TemporaryDirectory() as tmp:
        redis_srv = RedisServer(Path(tmp))
        master = MooncakeMaster(Path(tmp))
        redis_srv.start()
        master.start()
        try:
            # -- index
            index = PrefixIndex(redis_srv.url, "bench")
            chain = BlockHasher(unit=128, seed="bench").chain(list(range(164_000)))
            assert len(chain) == 1281
            chain = chain + BlockHasher(unit=128, seed="x").chain(list(range(19 * 128)))  # 1,300 hashes
            index.publish_store(chain[:1000], chain[999], 1000 * 128)
            for i in range(2):
                index.publish_local(prefill_name(i), chain[: 500 * (i + 1)], [chain[500 * (i + 1) - 1]])
                index.heartbeat(prefill_name(i))
            lat, ping = [], []
            for _ in tqdm(range(n_lookups), desc="index lookups", leave=False):
                lat.append(_timed(lambda: index.lookup(chain, 1300 * 128 + 1, 128, False)) * 1e3)
                ping.append(_timed(index.r.ping) * 1e3)
            res = index.lookup(chain, 1300 * 128 + 1, 128, False)
            assert res.store_hit == 1000 * 128 and res.instance_hits == {"prefill-0": 64000, "prefill-1": 128000}
            result["index_lookup"] = {
                "hashes": len(chain),
                "p50_ms": statistics.median(lat),
                "p99_ms": _pct(lat, 0.99),
                "redis_ping_p50_ms": statistics.median(ping),
            }
            # -- store
            store = CheckpointStore(master.address, master.metadata_url, "bench", segment_bytes=(repeats + 1) * nbytes)
            blob = torch.ones(nbytes, dtype=torch.uint8)
            puts, gets = [], []
            for i in range(repeats):
                key = "hpd/bench/blob/%d" % i
                puts.append(_timed(lambda k=key: store.put_objects([(k, "blob", 0, [blob])])))
                gets.append(_timed(lambda k=key: store.get_objects([k], "blob")))
            result["store"] = {
                "object_bytes": nbytes,
                "put_gbps": summary([nbytes / t / 1e9 for t in puts]),
                "get_gbps": summary([nbytes / t / 1e9 for t in gets]),
                "memcpy_gbps": _memcpy_gbps(nbytes, repeats),
            }
            store.close()
        finally:
            master.stop()
            redis_srv.stop()
    # -- NIXL
    from hybridpd.transfer.nixl_handoff import HandoffClient

    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_nixl_server, args=(nbytes, q_out, q_in))
    proc.start()
    rounds = repeats
    q_in.put(rounds)
    client = HandoffClient("bench-decode")
    times = []
    for _ in range(rounds):
        desc = q_out.get(timeout=120)
        times.append(_timed(lambda d=desc: client.fetch(d)))
    q_in.put("stop")
    proc.join(60)
    result["nixl"] = {
        "bytes": nbytes,
        "read_gbps_incl_verify": summary([nbytes / t / 1e9 for t in times]),
        "memcpy_gbps": _memcpy_gbps(nbytes, repeats),
    }
    return result


def markdown(out: dict[str, Any]) -> str:
    """The state-plane table of a run's JSON: medians (min-max) and same-run baselines."""
    il, st, nx = out["index_lookup"], out["store"], out["nixl"]

    def gbps(x: dict[str, Any], base: dict[str, Any]) -> str:
        return "%.2f GB/s (%.2f-%.2f; %.3fx memcpy)" % (x["median"], x["min"], x["max"], x["median"] / base["median"])

    mb = st["object_bytes"] >> 20
    return (
        "\n".join(
            [
                "| | measured (median of %d, min-max) | same-run baseline |" % out["repeats"],
                "|---|---|---|",
                "| index lookup, %d hashes, 2 live instances (one EVALSHA) | p50 %.2f ms, p99 %.2f ms"
                " | Redis PING p50 %.2f ms |" % (il["hashes"], il["p50_ms"], il["p99_ms"], il["redis_ping_p50_ms"]),
                "| MooncakeStore put, %d MB object | %s | memcpy %.1f GB/s |"
                % (mb, gbps(st["put_gbps"], st["memcpy_gbps"]), st["memcpy_gbps"]["median"]),
                "| MooncakeStore get (verified), %d MB | %s | memcpy %.1f GB/s |"
                % (mb, gbps(st["get_gbps"], st["memcpy_gbps"]), st["memcpy_gbps"]["median"]),
                "| NIXL READ across processes incl. xxh3 verify, %d MB | %s | memcpy %.1f GB/s |"
                % (
                    nx["bytes"] >> 20,
                    gbps(nx["read_gbps_incl_verify"], nx["memcpy_gbps"]),
                    nx["memcpy_gbps"]["median"],
                ),
            ]
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
