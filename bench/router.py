"""Router decision latency: hash chain + ONE index lookup + routing choice,
against vLLM's own block hashing of the same tokens, in the same process.

Tokenization is excluded. A real redis-server holds a realistic index: the
store has the first 80 % of the chain with a state checkpoint at its end, and
two live prefill instances hold the first 40 % / 60 % locally. Every decision
hashes the prompt from scratch (a cold chain: nothing is cached between
decisions), looks it up, merges the router's recent-prefill hints (64 other
streams remembered) and chooses, exactly as ``Dispatcher.route``
(services/router/dispatch.py) does.

The baseline (``bench/vllm_chain.py: baseline``), run every
``baseline_every``-th iteration, interleaved with the decisions so both see
the same machine: in the vLLM environment (``.venv-vllm/bin/hybridpd bench
router``) vLLM's own request block hasher, ``get_request_block_hasher(unit,
sha256_cbor)`` applied to a ``vllm.v1.request.Request`` of the tokens
(``baseline.kind = "vllm"``, with ``vllm_version`` and ``function``);
where vLLM does not import, the copy of its ``hash_block_tokens`` loop
(``kind = "copy"``, labelled "copy of vLLM's hash_block_tokens"). Its chain
is asserted equal to ours before anything is timed.

One repeat = a fresh redis-server and both prompt sizes, ``iterations``
decisions each; ``--repeats`` of them (bench/repeats.py: every repeat kept
with its provenance; the top-level fields are medians with ``min`` / ``max``).
Per size: decision p50/p99, its parts, the baseline's p50, and
``ratio_p99_vs_baseline`` = decision p99 / baseline p50. The budget
(``checks``): the median over repeats of that ratio at 164K tokens <= 0.1,
with how many repeats met it.

Wall-clock tails on a shared machine are mostly other processes' time
slices, so the same figures are also given in CPU time (``cpu_*``: this
thread's CPU time plus the Redis main thread's for the lookup, read from
``INFO cpu`` around each decision; the baseline's thread CPU time).

``markdown(out)`` renders the README tables from the JSON.
"""

from __future__ import annotations

import logging
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import repeats as repeats_mod
from bench import vllm_chain
from bench.report import spread, write_report
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from services.router.routing import RecentPrefills, choose

log = logging.getLogger(__name__)

#: the decision's p99 at 164K tokens must be at most this fraction of the baseline's p50 (median over repeats)
TARGET_RATIO = 0.1
NAMES = ["prefill-0", "prefill-1"]
SIZES = (16_384, 164_000)
SEED = "bench"


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(
    json_path: Path,
    iterations: int = 300,
    unit: int = 128,
    baseline_every: int = 10,
    repeats: int = 5,
    allow_vllm: bool = True,
) -> dict[str, Any]:
    """Measure ``repeats`` times, write JSON + PNG + markdown to ``json_path`` (and .png, .md)."""
    base = vllm_chain.baseline([1] * unit, unit, SEED, allow_vllm=allow_vllm).describe()  # imports vLLM up front
    log.info("baseline: %s (%s)", vllm_chain.label(base), base["function"])
    measured = repeats_mod.measure(
        lambda: _repeat(iterations, unit, baseline_every, allow_vllm),
        repeats,
        "router",
        uses_vllm=base["kind"] == "vllm",
    )
    ratios = [r["results"]["tokens_164000"]["ratio_p99_vs_baseline"] for r in measured["repeats"]]
    out = {
        "unit": unit,
        "iterations": iterations,
        "baseline_every": baseline_every,
        "baseline": base,
        **measured,
        "checks": {"ratio_p99_vs_baseline_164000": budget_check(ratios, TARGET_RATIO)},
    }
    bars = {}
    for k, v in out["results"].items():
        bars["%s decision p99" % k.removeprefix("tokens_")] = v["p99_ms"]
        bars["%s baseline p50" % k.removeprefix("tokens_")] = v["baseline_p50_ms"]
    title = "Router decision vs %s (median of %d)" % (vllm_chain.label(base), repeats)
    write_report(json_path, out, bars, "ms", title)
    json_path.with_suffix(".md").write_text(markdown(out))
    return out


def _repeat(iterations: int, unit: int, baseline_every: int, allow_vllm: bool) -> dict[str, Any]:
    """One complete measurement: a fresh redis-server, both sizes."""
    with tempfile.TemporaryDirectory() as tmp:
        srv = RedisServer(Path(tmp))
        srv.start()
        try:
            results = {
                "tokens_%d" % n: _one_size(srv.url, n, unit, iterations, baseline_every, allow_vllm) for n in SIZES
            }
        finally:
            srv.stop()
    return {"results": results}


def _one_size(url: str, n: int, unit: int, iterations: int, baseline_every: int, allow_vllm: bool) -> dict[str, Any]:
    index = PrefixIndex(url, "bench-router-%d" % n)
    hasher = BlockHasher(unit=unit, seed=SEED)
    rng = random.Random(n)
    tokens = [rng.randrange(0, 150_000) for _ in range(n)]
    chain = hasher.chain(tokens)
    baseline = vllm_chain.baseline(tokens, unit, SEED, allow_vllm=allow_vllm)
    assert baseline.chain() == chain, "our chain differs from the baseline's (%s)" % baseline.function
    k = int(len(chain) * 0.8)
    index.publish_store(chain[:k], chain[k - 1], k * unit)
    for i, frac in enumerate((0.4, 0.6)):
        m = int(len(chain) * frac)
        index.publish_local(NAMES[i], chain[:m], [chain[m - 1]])
        index.heartbeat(NAMES[i])
    recent = RecentPrefills(unit, 4 * unit, unit, eagle=False)
    for s in range(64):  # other streams' recent prefills: the merge looks at them all
        other = [s, *tokens[1 : 4096 + s * unit]]
        recent.record(NAMES[s % 2], hasher.chain(other), len(other), 0)
    queued = {NAMES[0]: 300.0, NAMES[1]: 0.0}
    lat, chain_ms, lookup_ms, base, cpu, base_cpu = [], [], [], [], [], []
    decision = None
    for i in tqdm(range(iterations), desc="%d tokens" % n, leave=False):
        s0 = _redis_cpu_ms(index)
        c0 = time.thread_time()
        t0 = time.perf_counter()
        h = hasher.chain(tokens)
        t1 = time.perf_counter()
        res = index.lookup(h, n, unit, False)
        t2 = time.perf_counter()
        local = recent.merge(h, n, res.instance_hits)
        decision = choose(n, NAMES, local, res.store_hit, queued)
        t3 = time.perf_counter()
        c1 = time.thread_time()
        cpu.append((c1 - c0) * 1e3 + _redis_cpu_ms(index) - s0)
        lat.append((t3 - t0) * 1e3)
        chain_ms.append((t1 - t0) * 1e3)
        lookup_ms.append((t2 - t1) * 1e3)
        if i % baseline_every == 0:
            c0 = time.thread_time()
            t0 = time.perf_counter()
            baseline.chain()
            base.append((time.perf_counter() - t0) * 1e3)
            base_cpu.append((time.thread_time() - c0) * 1e3)
    assert decision is not None and decision.store_hit == k * unit and decision.kind == "store_hit"
    base_p50 = statistics.median(base)
    return {
        "blocks": len(chain),
        "p50_ms": statistics.median(lat),
        "p99_ms": _pct(lat, 0.99),
        "chain_p50_ms": statistics.median(chain_ms),
        "lookup_p50_ms": statistics.median(lookup_ms),
        "lookup_p99_ms": _pct(lookup_ms, 0.99),
        "baseline_p50_ms": base_p50,
        "baseline_runs": len(base),
        "ratio_p50_vs_baseline": statistics.median(lat) / base_p50,
        "ratio_p99_vs_baseline": _pct(lat, 0.99) / base_p50,
        "cpu_p50_ms": statistics.median(cpu),
        "cpu_p99_ms": _pct(cpu, 0.99),
        "baseline_cpu_p50_ms": statistics.median(base_cpu),
        "cpu_ratio_p99_vs_baseline": _pct(cpu, 0.99) / statistics.median(base_cpu),
    }


def _redis_cpu_ms(index: PrefixIndex) -> float:
    """CPU time the Redis main thread has used (ms; microsecond resolution)."""
    info = index.r.info("cpu")
    return (float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])) * 1e3


# Shared with bench/overhead.py and bench/hashing.py: budgets on medians, and
# their markdown (medians with the repeats' range: bench/report.py ``spread``).


def budget_check(values: list[float], budget: float) -> dict[str, Any]:
    """A budget ``value <= budget`` judged on the median of the repeats' values,
    with their range and how many repeats met it on their own."""
    med = statistics.median(values)
    return {
        "budget": budget,
        "median": med,
        "min": min(values),
        "max": max(values),
        "met": med <= budget,
        "repeats_met": sum(v <= budget for v in values),
        "repeats": len(values),
    }


def legacy_note(out: dict[str, Any], command: str) -> str | None:
    """A line in place of the tables for a result written before repeats (no ``repeat_count``)."""
    if "repeat_count" in out:
        return None
    return "_This result predates repeats and baseline labels (no `repeat_count`): rerun `%s`._\n" % command


def repeats_phrase(n: int) -> str:
    """``"1 repeat"``, ``"3 repeats"``."""
    return "%d repeat%s" % (n, "" if n == 1 else "s")


def fmt_range(median: float, low: float, high: float, spec: str = "%.2f") -> str:
    """``"3.05 (2.98-3.20)"``: the median, with the repeats' min-max where they differ as printed."""
    m, lo, hi = spec % median, spec % low, spec % high
    return m if lo == hi else "%s (%s-%s)" % (m, lo, hi)


def checks_markdown(checks: dict[str, dict[str, Any]], names: dict[str, str], spec: str = "%.3f") -> list[str]:
    """A table of budget checks (``budget_check`` results), named by ``names``."""
    rows = ["| check | budget | median (min-max of repeats) | met | repeats that met it |", "|---|---|---|---|---|"]
    for key, c in checks.items():
        rows.append(
            "| %s | <= %s | %s | %s | %d of %d |"
            % (
                names.get(key, key),
                spec % c["budget"],
                fmt_range(c["median"], c["min"], c["max"], spec),
                "met" if c["met"] else "**missed**",
                c["repeats_met"],
                c["repeats"],
            )
        )
    return rows


def baseline_line(base: dict[str, Any]) -> str:
    """One sentence naming the baseline: kind, vLLM version, cbor2 version, the function timed."""
    cbor2 = ", cbor2 %s" % base["cbor2_version"] if base.get("cbor2_version") else ""
    if base["kind"] == "vllm":
        return "Baseline: vLLM's own block hashing, vLLM %s%s, `%s`, in the same process." % (
            base["vllm_version"],
            cbor2,
            base["function"],
        )
    return "Baseline: a copy of vLLM's `hash_block_tokens` loop (`%s`%s; vLLM not importable in this run)." % (
        base["function"],
        cbor2,
    )


def markdown(out: dict[str, Any]) -> str:
    """The README tables of a ``run`` result: medians with the repeats' range, baseline, checks."""
    legacy = legacy_note(out, ".venv-vllm/bin/hybridpd bench router")
    if legacy:
        return legacy
    base = out["baseline"]
    name = vllm_chain.label(base)
    rows = [
        "%s of %d decisions per size (unit %d; one baseline run per %d decisions). %s"
        % (
            repeats_phrase(out["repeat_count"]),
            out["iterations"],
            out["unit"],
            out["baseline_every"],
            baseline_line(base),
        ),
        "",
        "| prompt | blocks | p50 ms | p99 ms | chain p50 ms | lookup p50 ms | %s p50 ms | p50 / baseline"
        " | p99 / baseline |" % name,
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in out["results"].items():
        n = int(key.removeprefix("tokens_"))

        def f(field: str, spec: str = "%.2f", key: str = key) -> str:
            return spread(out, "results", key, field, spec=spec)

        rows.append(
            "| {:,} tokens | {:,} | {} | {} | {} | {} | {} | {} | {} |".format(
                n,
                int(r["blocks"]),
                f("p50_ms"),
                f("p99_ms"),
                f("chain_p50_ms"),
                f("lookup_p50_ms"),
                f("baseline_p50_ms", "%.1f"),
                f("ratio_p50_vs_baseline", "%.3f"),
                f("ratio_p99_vs_baseline", "%.3f"),
            )
        )
    rows += [
        "",
        "CPU time (this thread, plus the Redis main thread for the lookup):",
        "",
        "| prompt | CPU p50 ms | CPU p99 ms | baseline CPU p50 ms | CPU p99 / baseline CPU |",
        "|---|---|---|---|---|",
    ]
    for key in out["results"]:
        n = int(key.removeprefix("tokens_"))
        rows.append(
            "| {:,} tokens | {} | {} | {} | {} |".format(
                n,
                spread(out, "results", key, "cpu_p50_ms", spec="%.2f"),
                spread(out, "results", key, "cpu_p99_ms", spec="%.2f"),
                spread(out, "results", key, "baseline_cpu_p50_ms", spec="%.1f"),
                spread(out, "results", key, "cpu_ratio_p99_vs_baseline", spec="%.3f"),
            )
        )
    names = {"ratio_p99_vs_baseline_164000": "decision p99 / %s p50, 164,000 tokens" % name}
    rows += ["", *checks_markdown(out["checks"], names)]
    return "\n".join(rows) + "\n"
