"""Native engine throughput: prefill tokens/s, decode tokens/s, EAGLE.

    hybridpd bench eagle [--quick] [--model tiny] [--json bench/results/engine.json]

In one run: prefill throughput (prompt tokens / s, max_tokens=1), plain
decode throughput, and EAGLE decode throughput (k=3) with its mean
acceptance length at batch 1 and 8; the speedup is EAGLE vs plain decode on
the same requests, timed one right after the other. The whole measurement is
repeated ``--repeats`` times (each repeat with its own provenance); the JSON
keeps every repeat, and the published figures are the medians (with min and
max) over the repeats, the speedup being the median of each repeat's paired
ratio. Then the mean acceptance length at k = 1..5 (deterministic: greedy). Decode prompts are held-out text
(:mod:`hybridpd.models.corpus`, never trained on); greedy outputs of
every EAGLE run are checked equal to plain decoding.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.report import spread, write_report
from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.models.bundled import resolve_model_dir


def _engine(**kw: object) -> NativeEngine:
    base: dict[str, object] = {
        "model": _MODEL[0],
        "num_kv_blocks": 4096,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 64,
        "enable_prefix_caching": False,
    }
    base.update(kw)
    cfg = load_config(overrides=base)  # HYBRIDPD_* env vars apply (e.g. HYBRIDPD_DEVICE=cuda)
    return NativeEngine(cfg, resolve_model_dir(cfg.model))


_MODEL = ["tiny"]


def _prompts(n: int, length: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(5, 2048) for _ in range(length)) for _ in range(n)]


def _text_prompts(n: int, length: int) -> list[tuple[int, ...]]:
    """``n`` held-out text prompts of ``length`` tokens (consecutive windows of the held-out stream)."""
    from hybridpd.models.perplexity import heldout_windows

    rows = heldout_windows(resolve_model_dir(_MODEL[0]), n * length, length)
    return [tuple(r.tolist()) for r in rows[:n]]


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


def _repeat(n_pre: int, len_pre: int, n_dec: int, gen: int, text: list[tuple[int, ...]]) -> dict[str, Any]:
    """One repeat: prefill tokens/s, then per batch size plain and EAGLE decode back to back."""
    secs, _ = _run(_engine(), _prompts(n_pre, len_pre, 0), 1, "prefill")
    out: dict[str, Any] = {"prefill_tokens_per_s": n_pre * len_pre / secs, "decode": {}}
    for batch in (1, n_dec):
        decode_prompts = text[:batch]
        plain_s, plain_out = _run(_engine(), decode_prompts, gen, "decode-b%d" % batch)
        eagle_engine = _engine(eagle=True, num_speculative_tokens=3)
        eagle_s, eagle_out = _run(eagle_engine, decode_prompts, gen, "eagle-b%d" % batch)
        if list(plain_out.values()) != list(eagle_out.values()):
            raise SystemExit("EAGLE changed greedy outputs: refusing to report")
        plain_tps, eagle_tps = batch * gen / plain_s, batch * gen / eagle_s
        out["decode"]["batch_%d" % batch] = {
            "requests": batch,
            "generated_tokens": gen,
            "decode_tokens_per_s": plain_tps,
            "eagle_tokens_per_s": eagle_tps,
            "mean_acceptance_length": eagle_engine.spec.mean_acceptance_length,
            "eagle_speedup_vs_decode": eagle_tps / plain_tps,
            "decode_seconds": plain_s,
            "eagle_seconds": eagle_s,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    from bench.repeats import measure

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeats", "--reps", type=int, default=3, help="whole measurements; medians are published")
    ap.add_argument("--json", type=Path, default=Path("bench/results/engine.json"))
    args = ap.parse_args(argv)
    _MODEL[0] = args.model
    n_pre, len_pre = (4, 512) if args.quick else (8, 2048)
    n_dec, len_dec, gen = (4, 64, 32) if args.quick else (8, 128, 128)

    _run(_engine(), _prompts(2, 256, 2), 4, "warm-up")  # first-call costs (allocator, kernels) out of the timings
    text = _text_prompts(n_dec, len_dec)
    measured = measure(lambda: _repeat(n_pre, len_pre, n_dec, gen, text), args.repeats, "engine")
    decode_results = measured["decode"]
    prefill_tps = measured["prefill_tokens_per_s"]
    _, plain = _run(_engine(), text, gen, "decode-reference")
    by_k: dict[str, float] = {}
    for k in range(1, 6):
        eng = _engine(eagle=True, num_speculative_tokens=k)
        _, out = _run(eng, text, gen, "eagle-k%d" % k)
        if list(out.values()) != list(plain.values()):
            raise SystemExit("EAGLE (k=%d) changed greedy outputs: refusing to report" % k)
        by_k[str(k)] = eng.spec.mean_acceptance_length
    result = {
        "model": args.model,
        "quick": args.quick,
        "workload": {"prefill": [n_pre, len_pre], "decode": [n_dec, len_dec, gen]},
        **measured,
        "prefill": {"requests": n_pre, "prompt_tokens": len_pre, "tokens_per_s": prefill_tps},
        "eagle": {"num_speculative_tokens": 3, "mean_acceptance_length_by_k": by_k, "prompts": "held-out text"},
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
    print("mean acceptance length by k (batch %d): %s" % (n_dec, ", ".join("k=%s %.2f" % kv for kv in by_k.items())))
    print("prefill %.0f tok/s" % prefill_tps)
    bars: dict[str, float] = {}
    for name, r in decode_results.items():
        bars["decode " + name] = r["decode_tokens_per_s"]
        bars["eagle " + name] = r["eagle_tokens_per_s"]
    write_report(args.json, result, bars, "tokens/s", "Native %s model, CPU" % args.model)
    print("wrote %s" % args.json)


if __name__ == "__main__":
    main()


def markdown(out: dict[str, Any]) -> str:
    """The engine tables of a run's JSON: medians over the repeats (min-max where
    they differ), the EAGLE speed-up as the median of each repeat's paired ratio."""
    n = out.get("repeat_count", 1)
    pre = out["prefill"]
    rows = [
        "| | tokens/s (median of %d repeats) |" % n,
        "|---|---|",
        "| prefill, %d x %d-token prompts | %s |"
        % (pre["requests"], pre["prompt_tokens"], spread(out, "prefill_tokens_per_s", spec="%.0f")),
    ]
    # "requests" is a per-repeat key (bench/repeats.py): the batch sizes are the first repeat's
    first = (out.get("repeats") or [out])[0]["decode"]
    batch = {name: int(first[name]["requests"]) for name in out["decode"]}
    for name, r in out["decode"].items():
        plural = "s" if batch[name] > 1 else ""
        rows.append(
            "| decode, %d request%s | %s |" % (batch[name], plural, spread(out, "decode", name, "decode_tokens_per_s"))
        )
        rows.append(
            "| decode + EAGLE, %d request%s | %s (x%s; mean acceptance length %.2f) |"
            % (
                batch[name],
                plural,
                spread(out, "decode", name, "eagle_tokens_per_s"),
                spread(out, "decode", name, "eagle_speedup_vs_decode", spec="%.2f"),
                r["mean_acceptance_length"],
            )
        )
    by_k = out["eagle"]["mean_acceptance_length_by_k"]
    rows += [
        "",
        "| k (%d requests) | %s |" % (max(batch.values()), " | ".join(by_k)),
        "|---|%s" % ("---|" * len(by_k)),
        "| mean acceptance length | %s |" % " | ".join("%.2f" % v for v in by_k.values()),
    ]
    return "\n".join(rows) + "\n"
