"""bench/README.md's tables and headline numbers, generated from the committed JSON.

    python -m bench.tables            # rewrite the generated blocks of bench/README.md
    python -m bench.tables --check    # exit 1, with a diff, where a block differs

A block lies between ``<!-- generated: NAME -->`` and ``<!-- /generated: NAME -->``;
everything between the markers is this script's, everything outside them is
prose (which interprets, and cites no number the JSON lacks). Each block is
a pure function of one results file: a provenance line (dates, commit, load,
versions, repeats, whether the variants were one run), the table of medians
(with min-max of the repeats where they differ), and the file's ``checks``.
A result recorded from a dirty tree is refused: it is never published.
``tests/unit/test_bench_tables.py`` regenerates every block and fails on any
difference.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import provenance
from bench.report import spread

RESULTS = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parent / "README.md"

_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /generated: (?P=name) -->)", re.S)


class DirtyResultError(ValueError):
    """A results file recorded from a tree with uncommitted code changes."""


def _records(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Every provenance record in a results file (top level, per repeat, per variant)."""
    found: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            p = x.get("provenance")
            if isinstance(p, dict) and "commit" in p:
                found.append(p)
            elif isinstance(p, list):
                found.extend(r for r in p if isinstance(r, dict) and "commit" in r)
            for k, v in x.items():
                if k not in ("provenance", "repeats"):
                    walk(v)

    walk(out)
    unique = {(r["commit"], r["started"]): r for r in found}
    return sorted(unique.values(), key=lambda r: r["started"])


def _repeat_counts(out: dict[str, Any]) -> list[int]:
    if isinstance(out.get("variants"), dict):
        return sorted({int(v.get("repeat_count", 1)) for v in out["variants"].values()})
    for key in ("repeat_count", "repeats"):
        if isinstance(out.get(key), int):
            return [out[key]]
    return [1]


def provenance_line(name: str, out: dict[str, Any]) -> str:
    """Where the numbers of ``out`` come from, in one paragraph."""
    recs = _records(out)
    if not recs:
        m = out.get("machine", {})
        return (
            "_`%s`: written %s at commit %s, before runs kept their provenance (no dirty flag, load or versions"
            " recorded; one run, no repeats): a record, not a headline._\n"
            % (name, m.get("date") or m.get("written_utc", "?"), m.get("commit", "?"))
        )
    dirty = [r for r in recs if r["dirty"]]
    if dirty:
        raise DirtyResultError(
            "%s: recorded from a dirty tree at %s (commit %s): rerun it from a clean checkout"
            % (name, dirty[0]["started_utc"], dirty[0]["commit"][:7])
        )
    span = provenance.span(recs)
    versions: dict[str, set[str]] = {}
    for r in recs:
        for k, v in r.get("versions", {}).items():
            if v:
                versions.setdefault(k, set()).add(v)
    load = [x for r in recs for x in (r["load_average_before"][0], (r.get("load_average_after") or [0])[0])]
    counts = _repeat_counts(out)
    cpu = recs[0].get("machine", {})
    parts = [
        "`%s`: run %s to %s, commit %s"
        % (name, span["started_utc"], span["ended_utc"], ", ".join(c[:7] for c in span["commits"])),
        "%s repeat%s%s"
        % ("/".join(map(str, counts)), "s" if counts != [1] else "", " per variant" if "variants" in out else ""),
        "load average (1 min) %.1f-%.1f" % (min(load), max(load)),
        "%s, %s CPUs" % (cpu.get("cpu", "?"), cpu.get("cpus", "?")),
        ", ".join("%s %s" % (k, "/".join(sorted(v))) for k, v in sorted(versions.items())),
    ]
    if isinstance(out.get("variants"), dict) and len(out["variants"]) > 1:
        same = provenance.same_run(recs)
        parts.append("the variants %s one run" % ("are" if same else "are **not** (merged reruns)"))
    return "_" + "; ".join(parts) + "._\n"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "holds" if v else "**MISSED**"
    if isinstance(v, float):
        return "%.4g" % v
    if isinstance(v, list) and not v:
        return "none"
    return "`%s`" % json.dumps(v) if not isinstance(v, str) else v


def checks_lines(out: dict[str, Any]) -> str:
    """The file's ``checks``, one bullet each (a false check reads MISSED)."""
    checks = out.get("checks")
    if not checks:
        return ""
    lines = ["", "Checks (`checks` in the JSON, judged on the medians; per-request bounds in every repeat):", ""]
    lines += ["- `%s`: %s" % (k, _value(v)) for k, v in checks.items()]
    return "\n".join(lines) + "\n"


def _vs_lines(out: dict[str, Any]) -> str:
    """Ratios of each variant against the same run's baselines (growing streams' ``vs_*``)."""
    rows = []
    for name, v in out["variants"].items():
        for key, r in v.items():
            if key.startswith("vs_"):
                rows.append(
                    "| %s | %s | %.3f | %.3f | %.3f |"
                    % (name, key[3:], r["recomputed_tokens"], r["ttft_p50"], r["throughput"])
                )
    if not rows:
        return ""
    head = [
        "",
        "Against the baselines of the same run (ratios of the medians):",
        "",
        "| variant | baseline | recomputed tokens | TTFT p50 | throughput |",
        "|---|---|---|---|---|",
    ]
    return "\n".join(head + rows) + "\n"


def _notes(out: dict[str, Any]) -> str:
    notes = out.get("notes") or {}
    return "".join("\n- `%s`: %s\n" % kv for kv in notes.items())


def _soak(out: dict[str, Any]) -> str:
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


def _vllm_client(out: dict[str, Any]) -> str:
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


def _promises(out: dict[str, Any]) -> str:
    rows = ["| | |", "|---|---|"]

    def cell(v: Any) -> str:  # counts as counts (the metric deltas are floats)
        whole = isinstance(v, int | float) and not isinstance(v, bool) and float(v).is_integer()
        return f"{int(v):,}" if whole else _value(v)

    rows += ["| %s | %s |" % (k, cell(out[k])) for k in PROMISE_KEYS if k in out]
    return "\n".join(rows) + "\n"


def _gpu_check(out: dict[str, Any]) -> str:
    rows = ["| | |", "|---|---|"]
    for k, v in out.items():
        if k != "machine" and not isinstance(v, dict | list):
            rows.append("| %s | %s |" % (k, _value(v)))
    return "\n".join(rows) + "\n"


def _module_markdown(module: str) -> Callable[[dict[str, Any]], str]:
    def render(out: dict[str, Any]) -> str:
        import importlib

        text: str = importlib.import_module(module).markdown(out)
        return text

    return render


def _variants_table(module: str) -> Callable[[dict[str, Any]], str]:
    md = _module_markdown(module)
    return lambda out: md(out) + _vs_lines(out) + _notes(out)


#: block name -> (results file, table renderer)
BLOCKS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "growing-streams": ("growing_streams.json", _variants_table("bench.growing_streams")),
    "growing-streams-quick": ("growing_streams_quick.json", _variants_table("bench.growing_streams")),
    "shared-prefix": ("shared_prefix.json", _variants_table("bench.shared_prefix_run")),
    "shared-prefix-quick": ("shared_prefix_quick.json", _variants_table("bench.shared_prefix_run")),
    "shared-prefix-placement-quick": (
        "shared_prefix_placement_quick.json",
        _variants_table("bench.shared_prefix_run"),
    ),
    "placement": ("placement.json", _module_markdown("bench.placement")),
    "multi-turn": ("multi_turn.json", _variants_table("bench.multi_turn_run")),
    "multi-turn-quick": ("multi_turn_quick.json", _variants_table("bench.multi_turn_run")),
    "overhead": ("overhead.json", _module_markdown("bench.overhead")),
    "vllm-client": ("vllm_client.json", _vllm_client),
    "vllm-client-pd-quick": ("vllm_client_pd_quick.json", _vllm_client),
    "vllm-client-pd": ("vllm_client_pd.json", _vllm_client),
    "router": ("router.json", _module_markdown("bench.router")),
    "index-scale": ("index_scale.json", _module_markdown("bench.index_scale")),
    "index-scale-quick": ("index_scale_quick.json", _module_markdown("bench.index_scale")),
    "hashing": ("hashing.json", _module_markdown("bench.hashing")),
    "engine": ("engine.json", _module_markdown("bench.engine")),
    "eagle-ab": ("eagle_ab.json", _module_markdown("bench.eagle_ab")),
    "state-plane": ("state_plane.json", _module_markdown("bench.state_plane")),
    "soak": ("soak.json", _soak),
    "vllm-index-promises": ("vllm_index_promises.json", _promises),
    "gpu-check-float32": ("gpu_check_float32.json", _gpu_check),
    "gpu-check-bfloat16": ("gpu_check_bfloat16.json", _gpu_check),
}


#: blocks whose module's ``markdown`` renders its checks itself (as a budget table)
RENDER_OWN_CHECKS = frozenset({"router", "overhead", "index-scale", "index-scale-quick"})


def render_block(name: str, results: Path = RESULTS) -> str:
    """The generated text of block ``name`` from its results file."""
    if name not in BLOCKS:
        raise KeyError("unknown generated block %r (known: %s)" % (name, ", ".join(BLOCKS)))
    filename, table = BLOCKS[name]
    path = results / filename
    if not path.exists():
        return "_No results file `bench/results/%s` yet._\n" % filename
    out = json.loads(path.read_text())
    own_checks = name in RENDER_OWN_CHECKS
    return "%s\n%s%s" % (provenance_line(filename, out), table(out), "" if own_checks else checks_lines(out))


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every generated block replaced by its current rendering."""

    def sub(m: re.Match[str]) -> str:
        return m.group(1) + render_block(m.group("name"), results) + m.group(4)

    return _BLOCK.sub(sub, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 with a diff where a block differs")
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args(argv)
    old = args.readme.read_text()
    new = render(old)
    if args.check:
        if new != old:
            sys.stdout.writelines(
                difflib.unified_diff(old.splitlines(True), new.splitlines(True), "README", "generated")
            )
            return 1
        return 0
    if new != old:
        args.readme.write_text(new)
        print("rewrote %s" % args.readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
