"""Block-hash chain speed: ours vs vLLM's own block hashing, in the same process.

    python -m bench.hashing [--tokens 164000] [--unit 128] [--iterations 30] [--repeats 3] [--json PATH]

The baseline (``bench/vllm_chain.py: baseline``): run from the vLLM
environment (``.venv-vllm/bin/python -m bench.hashing``), vLLM's own request
block hasher, ``get_request_block_hasher(unit, sha256_cbor | xxhash_cbor)``
applied to a ``vllm.v1.request.Request`` of the tokens (``baseline.kind =
"vllm"``, with ``vllm_version`` and ``function``); where vLLM does not import,
the copy of its ``hash_block_tokens`` loop (``kind = "copy"``, labelled "copy
of vLLM's hash_block_tokens"). Both chains must be identical before anything
is timed. The top-level ``baseline.function`` writes the algorithm as
``<algorithm>``; each algorithm's ``baseline_function`` names it.

One repeat: per algorithm, ``iterations`` timed chains of ours from an int64
array and from a list, and every 5th iteration (at least 3 in all) the
baseline's, interleaved. ``--repeats`` of them (bench/repeats.py: every
repeat kept with its provenance; the top-level fields are medians with
``min`` / ``max``). ``markdown(out)`` renders the README table from the JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench import repeats as repeats_mod
from bench import vllm_chain
from bench.report import spread, write_report
from bench.router import baseline_line, legacy_note, repeats_phrase
from hybridpd.hashing import BlockHasher, HashAlgo

SEED = "bench"
BASELINE_EVERY = 5


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _repeat(tokens: np.ndarray, unit: int, iterations: int, allow_vllm: bool) -> dict[str, Any]:
    """One complete measurement: every algorithm, ours and the baseline interleaved."""
    as_list = tokens.tolist()
    results = {}
    for algo in HashAlgo:
        hasher = BlockHasher(unit=unit, algo=algo, seed=SEED)
        base = vllm_chain.baseline(as_list, unit, SEED, algo, allow_vllm)
        assert base.chain() == hasher.chain(tokens), "our chain differs from the baseline's (%s)" % base.function
        ours, ours_list, theirs = [], [], []
        for i in range(max(iterations, 3 * BASELINE_EVERY)):
            if i < iterations:
                ours.append(_ms(partial(hasher.chain, tokens)))
                ours_list.append(_ms(partial(hasher.chain, as_list)))
            if i % BASELINE_EVERY == 0:
                theirs.append(_ms(base.chain))
        results[algo.value] = {
            "blocks": len(as_list) // unit,
            "ours_ms_p50": statistics.median(ours),
            "ours_list_input_ms_p50": statistics.median(ours_list),
            "baseline_ms_p50": statistics.median(theirs),
            "baseline_runs": len(theirs),
            "speedup": statistics.median(theirs) / statistics.median(ours),
            "speedup_list_input": statistics.median(theirs) / statistics.median(ours_list),
            "baseline_function": base.function,
        }
    return {"results": results}


def run(
    json_path: Path,
    tokens: int = 164_000,
    unit: int = 128,
    iterations: int = 30,
    repeats: int = 3,
    allow_vllm: bool = True,
) -> dict[str, Any]:
    """Measure ``repeats`` times; write JSON + PNG + markdown to ``json_path`` (and .png, .md)."""
    ids = np.random.default_rng(0).integers(0, 160_000, size=tokens, dtype=np.int64)
    base = vllm_chain.baseline([1] * unit, unit, SEED, allow_vllm=allow_vllm).describe()
    base["function"] = base["function"].replace(HashAlgo.SHA256_CBOR.value, "<algorithm>")  # each: baseline_function
    measured = repeats_mod.measure(
        lambda: _repeat(ids, unit, iterations, allow_vllm), repeats, "hashing", uses_vllm=base["kind"] == "vllm"
    )
    out = {"tokens": tokens, "unit": unit, "iterations": iterations, "baseline": base, **measured}
    name = vllm_chain.label(base)
    bars = {"%s ours" % k: v["ours_ms_p50"] for k, v in out["results"].items()}
    bars.update({"%s %s" % (k, name): v["baseline_ms_p50"] for k, v in out["results"].items()})
    title = "Hash chain, %d tokens at unit %d (median of %d)" % (tokens, unit, repeats)
    write_report(json_path, out, bars, "ms per chain (p50)", title)
    json_path.with_suffix(".md").write_text(markdown(out))
    return out


def markdown(out: dict[str, Any]) -> str:
    """The README table of a ``run`` result: medians with the repeats' range, and the baseline."""
    legacy = legacy_note(out, ".venv-vllm/bin/python -m bench.hashing")
    if legacy:
        return legacy
    name = vllm_chain.label(out["baseline"])
    rows = [
        "%s of %d timed chains per algorithm, %s tokens at unit %d. %s"
        % (
            repeats_phrase(out["repeat_count"]),
            out["iterations"],
            f"{out['tokens']:,}",
            out["unit"],
            baseline_line(out["baseline"]),
        ),
        "",
        "| algorithm | blocks | ours (int64 array) ms | ours (list) ms | %s ms | speedup | speedup (list) |" % name,
        "|---|---|---|---|---|---|---|",
    ]
    for algo, r in out["results"].items():

        def f(field: str, spec: str = "%.2f", algo: str = algo) -> str:
            return spread(out, "results", algo, field, spec=spec)

        rows.append(
            "| {} | {:,} | {} | {} | {} | x{} | x{} |".format(
                algo,
                int(r["blocks"]),
                f("ours_ms_p50"),
                f("ours_list_input_ms_p50"),
                f("baseline_ms_p50", "%.1f"),
                f("speedup", "%.1f"),
                f("speedup_list_input", "%.1f"),
            )
        )
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=164_000)
    ap.add_argument("--unit", type=int, default=128)
    ap.add_argument("--iterations", type=int, default=30, help="timed chains of ours per algorithm and repeat")
    ap.add_argument("--repeats", type=int, default=3, help="complete measurements; the JSON keeps each")
    ap.add_argument("--json", type=Path, default=Path("bench/results/hashing.json"))
    ap.add_argument("--copy", action="store_true", help="time the copy of vLLM's loop even where vLLM imports")
    args = ap.parse_args()
    out = run(args.json, args.tokens, args.unit, args.iterations, args.repeats, not args.copy)
    name = vllm_chain.label(out["baseline"])
    for algo, r in out["results"].items():
        print(
            "%-12s ours %.2f ms (list %.2f)  %s %.2f ms  speedup %.1fx"
            % (algo, r["ours_ms_p50"], r["ours_list_input_ms_p50"], name, r["baseline_ms_p50"], r["speedup"])
        )
    print("baseline: %s" % out["baseline"])
    print("wrote %s (+ .png, .md)" % args.json)


if __name__ == "__main__":
    main()
