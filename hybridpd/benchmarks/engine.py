"""Native engine throughput: prefill tokens/s, decode tokens/s, EAGLE.

    python -m bench.engine [--quick] [--json bench/results/engine.json]

In one run: prefill throughput (prompt tokens / s, max_tokens=1), plain
decode throughput, and EAGLE decode throughput with its mean acceptance
length; the speedup is EAGLE vs plain decode on the same requests. Greedy
outputs of both decode runs are checked equal.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from tqdm import tqdm

from hybridpd.benchmarks.report import write_report
from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.engine import NativeEngine


def _engine(**kw: object) -> NativeEngine:
    base: dict[str, object] = {
        "num_kv_blocks": 4096,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 64,
        "enable_prefix_caching": False,
    }
    base.update(kw)
    return NativeEngine(load_config(overrides=base))  # HYBRIDPD_* env vars apply (e.g. HYBRIDPD_DEVICE=cuda)


def _prompts(n: int, length: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(5, 2048) for _ in range(length)) for _ in range(n)]


def _run(engine: NativeEngine, prompts: list[tuple[int, ...]], max_tokens: int, label: str) -> tuple[float, dict]:
    reqs = [
        EngineRequest(RequestId("%s%d" % (label, i)), p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    bar = tqdm(total=len(reqs) * max_tokens, desc=label, leave=False)
    t0 = time.perf_counter()
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            bar.update(len(o.new_token_ids))
    bar.close()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=Path("bench/results/engine.json"))
    args = ap.parse_args(argv)
    n_pre, len_pre = (4, 512) if args.quick else (8, 2048)
    n_dec, len_dec, gen = (4, 64, 32) if args.quick else (8, 128, 128)

    prefill_prompts = _prompts(n_pre, len_pre, 0)
    secs, _ = _run(_engine(), prefill_prompts, 1, "prefill")
    prefill_tps = n_pre * len_pre / secs

    decode_results = {}
    for batch in (1, n_dec):
        decode_prompts = _prompts(batch, len_dec, 1)
        plain_s, plain_out = _run(_engine(), decode_prompts, gen, "decode-b%d" % batch)
        eagle_engine = _engine(eagle=True, num_speculative_tokens=3)
        eagle_s, eagle_out = _run(eagle_engine, decode_prompts, gen, "eagle-b%d" % batch)
        if list(plain_out.values()) != list(eagle_out.values()):
            raise SystemExit("EAGLE changed greedy outputs: refusing to report")
        plain_tps, eagle_tps = batch * gen / plain_s, batch * gen / eagle_s
        decode_results["batch_%d" % batch] = {
            "requests": batch,
            "generated_tokens": gen,
            "decode_tokens_per_s": plain_tps,
            "eagle_tokens_per_s": eagle_tps,
            "mean_acceptance_length": eagle_engine.spec.mean_acceptance_length,
            "eagle_speedup_vs_decode": eagle_tps / plain_tps,
        }
    result = {
        "prefill": {"requests": n_pre, "prompt_tokens": len_pre, "tokens_per_s": prefill_tps},
        "decode": decode_results,
        "eagle": {"num_speculative_tokens": 3},
        "quick": args.quick,
    }
    for name, r in decode_results.items():
        print(
            "%s: decode %.1f tok/s | eagle %.1f tok/s (x%.2f, acceptance length %.2f)"
            % (
                name,
                r["decode_tokens_per_s"],
                r["eagle_tokens_per_s"],
                r["eagle_speedup_vs_decode"],
                r["mean_acceptance_length"],
            )
        )
    print("prefill %.0f tok/s" % prefill_tps)
    bars = {}
    for name, r in decode_results.items():
        bars["decode " + name] = r["decode_tokens_per_s"]
        bars["eagle " + name] = r["eagle_tokens_per_s"]
    write_report(args.json, result, bars, "tokens/s", "Native tiny model, CPU")
    print("wrote %s" % args.json)


if __name__ == "__main__":
    main()
