"""The tables of bench/README.md's generated blocks, one renderer per kind of results
file (``bench.tables.BLOCKS`` names which file each block shows): a renderer takes the
file's JSON (one machine kind's variants of it) and returns markdown.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import provenance
from bench.provenance_text import value_text
from bench.report import spread

RESULTS = Path(__file__).resolve().parent / "results"


def _vs_lines(out: dict[str, Any]) -> str:
    """Each variant's TTFT p50 over each baseline's (growing streams' ``vs_*``; the
    ratios of recomputed tokens and throughput are in the JSON), one row per variant,
    a ratio only where the two are one run."""
    variants = out["variants"]
    cells: dict[str, dict[str, str]] = {}
    bases: list[str] = []
    left = 0
    for name, v in variants.items():
        for key, r in v.items():
            base = key[3:]
            if not key.startswith("vs_"):
                continue
            if variants.get(base) is None or not provenance.variants_same_run([v, variants[base]]):
                left += 1
                continue
            bases += [base] if base not in bases else []
            cells.setdefault(name, {})[base] = "%.3f" % r["ttft_p50"]
    out_lines = []
    if cells:
        out_lines += [
            "",
            "TTFT p50 against the baselines of the same run (ratios of the medians):",
            "",
            "| variant | %s |" % " | ".join("/ %s" % b for b in bases),
            "|---|%s" % ("---|" * len(bases)),
            *("| %s | %s |" % (n, " | ".join(c.get(b, "-") for b in bases)) for n, c in cells.items()),
        ]
    if left:
        out_lines += ["", "%d ratios against a baseline left out: not one run (not comparable)." % left]
    return "\n".join(out_lines) + "\n" if out_lines else ""


def _notes(out: dict[str, Any]) -> str:
    notes = out.get("notes") or {}
    return "".join("\n- `%s`: %s\n" % kv for kv in notes.items())


def soak(out: dict[str, Any]) -> str:
    cfg = out["config"]
    growth = ", ".join("%s %+.0f" % (k, v) for k, v in out["rss_growth_mb_after_warmup"].items())
    rows = [
        "| | |",
        "|---|---|",
        "| streams x minutes | %d x %.1f |" % (cfg["streams"], cfg["minutes"]),
        "| requests | %d ok, %d failed |" % (out["requests_ok"], out["requests_failed"]),
        "| repeated prompts | %d distinct, %d answers differing from the first answer to the same prompt |"
        % (out["distinct_prompts"], out["inconsistent_outputs"]),
    ]
    if out.get("reference"):
        rows.append(
            "| no-cache reference (%s) | %d of %d sampled prompts differ (fp32 rows batch-invariant here: %s) |"
            % (out["reference"], out["reference_mismatches"], out["reference_sampled"], out["reference_row_invariant"])
        )
    rows += [
        "| pools at the end | %s |"
        % ("every block and slot free" if out["pools_back_to_baseline"] else "**not free**"),
        "| load | %.1f requests/s, %.0f tokens/s, %.3f of prompt tokens from caches |"
        % (out["requests_per_s"], out["tokens_per_s"], out["cached_token_fraction"]),
        "| TTFT | p50 %.0f ms, p99 %.0f ms |" % (out["ttft_p50_ms"], out["ttft_p99_ms"]),
        "| RSS growth after warm-up, MiB | %s |" % growth,
    ]
    return "\n".join(rows) + "\n"


def _stages(means: dict[str, float] | None) -> str:
    """The router's TTFT stages of one workload (medians over the repeats), or a dash."""
    if not means:
        return "-"
    return " / ".join("%.1f" % means[s] if s in means else "-" for s in ("queue", "prefill", "prefill_call", "decode"))


def vllm_client(out: dict[str, Any]) -> str:
    rows = [
        "| target | workload | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s"
        " | TTFT stages, mean ms (queue / prefill / prefill call / decode) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    legacy = "variants" not in out  # written before repeats: {"results": {target: {workload: {...}}}}
    for target, v in (out["results"] if legacy else out["variants"]).items():
        for name in v if legacy else out["workloads"]:
            rows.append(
                "| %s | %s | %s | %s | %s | %s | %s | %s |"
                % (
                    target,
                    name,
                    spread(v, name, "median_ttft_ms"),
                    spread(v, name, "p99_ttft_ms"),
                    spread(v, name, "median_itl_ms", spec="%.2f"),
                    spread(v, name, "p99_itl_ms", spec="%.2f"),
                    spread(v, name, "output_throughput"),
                    _stages((v.get(name) or {}).get("ttft_stage_mean_ms")),
                )
            )
    return "\n".join(rows) + "\n"


#: the totals of tests/vllm/test_index_promises.py's full run, in order
PROMISE_KEYS = (
    "requests",
    "requests_promised",
    "promised_tokens",
    "cached_tokens",
    "prompt_tokens",
    "over_promises",
    "over_promised_tokens",
    "under_promises",
    "under_promised_tokens",
    "metric_kept",
    "metric_broken",
    "kv_blocks_per_engine",
    "pinned_share",
    "seed",
)


def promises(out: dict[str, Any]) -> str:
    def cell(v: Any) -> str:  # counts as counts (the metric deltas are floats)
        whole = isinstance(v, int | float) and not isinstance(v, bool) and float(v).is_integer()
        return f"{int(v):,}" if whole else value_text(v)

    keys = [k for k in PROMISE_KEYS if k in out]
    return (
        "| "
        + " | ".join(keys)
        + " |\n|"
        + "---|" * len(keys)
        + "\n| "
        + " | ".join(cell(out[k]) for k in keys)
        + " |\n"
    )


def module_markdown(module: str) -> Callable[[dict[str, Any]], str]:
    def render(out: dict[str, Any]) -> str:
        import importlib

        text: str = importlib.import_module(module).markdown(out)
        return text

    return render


def first_table(module: str) -> Callable[[dict[str, Any]], str]:
    """The module's markdown up to its first blank line (its main table)."""
    md = module_markdown(module)
    return lambda out: md(out).split("\n\n", 1)[0].rstrip("\n") + "\n" + _notes(out)


def dropping(module: str, *prefixes: str) -> Callable[[dict[str, Any]], str]:
    """The module's markdown without the paragraphs starting with ``prefixes`` (and,
    after such a paragraph ending in a colon, the table it introduces): detail the
    run's own ``.md`` keeps."""
    md = module_markdown(module)

    def render(out: dict[str, Any]) -> str:
        kept, skip = [], 0
        for chunk in md(out).rstrip("\n").split("\n\n"):
            if chunk.startswith(prefixes):
                skip = 2 if chunk.rstrip().endswith((":", ").")) and not chunk.startswith("|") else 1
            if skip:
                skip -= 1
                continue
            kept.append(chunk)
        return "\n\n".join(kept) + "\n"

    return render


def variants_table(module: str) -> Callable[[dict[str, Any]], str]:
    """The module's main table (its other tables: the run's ``.md``), each variant's
    TTFT against the baselines of the same run, and the notes."""
    md = module_markdown(module)
    return lambda out: md(out).split("\n\n", 1)[0].rstrip("\n") + "\n" + _vs_lines(out) + _notes(out)


def shared_prefix(out: dict[str, Any]) -> str:
    """Variants by phase: cached / ideal (counted requests), and the TTFT p50 over the
    whole plan; the per-phase TTFTs, token counts and state bytes are the run's own
    ``.md`` beside its JSON."""
    from bench.shared_prefix_run import _phases, plan_ttft_p50

    v = out["variants"]
    phases = _phases(v)
    rows = [
        "| variant | repeats | " + " | ".join(phases) + " | TTFT p50 ms, whole plan |",
        "|---|---|" + "---|" * len(phases) + "---|",
    ]
    for k, x in v.items():
        cells = [spread(x, "phases", p, "hit_ratio", spec="%.3f") if p in x["phases"] else "-" for p in phases]
        plan = plan_ttft_p50(x)
        cells.append("-" if plan is None else "%.0f" % plan)
        rows.append("| %s | %d | %s |" % (k, x.get("repeat_count", 1), " | ".join(cells)))
    return "cached / ideal per phase (counted requests):\n\n" + "\n".join(rows) + "\n" + _notes(out)


#: the placement report's policies: (label, key in each workload)
PLACEMENT_POLICIES = (
    ("tail + junction", "tail+junction"),
    ("geometric", "geometric"),
    ("value", "value"),
    ("value, min gain 0", "value_no_min_gain"),
    ("value, at most one, min gain 0", "value_one_no_min_gain"),
)


def placement(out: dict[str, Any]) -> str:
    """Policies by workload: hit / ideal (states written)."""
    w = out["workloads"]
    rows = ["| policy | " + " | ".join(w) + " |", "|---|" + "---|" * len(w)]
    for label, key in PLACEMENT_POLICIES:
        rows.append(
            "| %s | %s |"
            % (label, " | ".join("%.3f (%d)" % (x[key]["hit_ratio"], x[key]["states"]) for x in w.values()))
        )
    best = [
        "%.3f (%d, every %d)" % (b["hit_ratio"], b["states"], b["interval"]) if b else "-"
        for b in (x["best_interval"] for x in w.values())
    ]
    rows.append("| highest-hit fixed interval with at most `value`'s states | %s |" % " | ".join(best))
    return "Hit / ideal (states written):\n\n" + "\n".join(rows) + "\n"
