"""Block-hash chain speed: ours vs vLLM's per-block cbor2 formulation.

    python -m bench.hashing [--tokens 164000] [--unit 128] [--json PATH]

The baseline is the same chain computed the way vLLM 0.32 does it
(``bench/vllm_chain.py``: its ``hash_block_tokens``, one
``cbor2.dumps`` + digest per block), in the same process; both must produce
identical hashes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.report import write_report
from bench.vllm_chain import vllm_chain
from hybridpd.hashing import BlockHasher, HashAlgo


def _time(fn: Callable[..., object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=164_000)
    ap.add_argument("--unit", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", type=Path, default=Path("bench/results/hashing.json"))
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 160_000, size=args.tokens, dtype=np.int64)
    as_list = tokens.tolist()
    results = {}
    for algo in HashAlgo:
        hasher = BlockHasher(unit=args.unit, algo=algo, seed="bench")

        def baseline(h: BlockHasher = hasher, a: HashAlgo = algo) -> list[bytes]:
            return vllm_chain(as_list, args.unit, h.none_hash, a)

        assert baseline() == hasher.chain(tokens), "fast chain differs from the reference"
        ours = _time(lambda h=hasher: h.chain(tokens), args.repeat)
        ours_list = _time(lambda h=hasher: h.chain(as_list), args.repeat)
        base = _time(baseline, max(3, args.repeat // 5))
        results[algo.value] = {
            "ours_ms_p50": statistics.median(ours),
            "ours_ms_min": min(ours),
            "ours_list_input_ms_p50": statistics.median(ours_list),
            "vllm_style_ms_p50": statistics.median(base),
            "speedup": statistics.median(base) / statistics.median(ours),
            "blocks": len(as_list) // args.unit,
        }
        print(
            "%-12s ours %.2f ms  vllm-style %.2f ms  speedup %.1fx"
            % (
                algo.value,
                results[algo.value]["ours_ms_p50"],
                results[algo.value]["vllm_style_ms_p50"],
                results[algo.value]["speedup"],
            )
        )
    bars = {"%s ours" % k: v["ours_ms_p50"] for k, v in results.items()}
    bars.update({"%s vllm-style" % k: v["vllm_style_ms_p50"] for k, v in results.items()})
    write_report(
        args.json,
        {"tokens": args.tokens, "unit": args.unit, "results": results},
        bars,
        "ms per chain (p50)",
        "Hash chain, %d tokens at unit %d" % (args.tokens, args.unit),
    )
    print("wrote %s" % args.json)


if __name__ == "__main__":
    main()
