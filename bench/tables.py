# Over 350 lines: every generated table and number of the docs, with the rules that judge comparisons.
"""bench/README.md's tables, and every generated number of the docs, from the committed JSON.

    python -m bench.tables            # rewrite the generated blocks and numbers
    python -m bench.tables --check    # exit 1, with a diff, where one differs

Two kinds of generated text:

* a **block** between ``<!-- generated: NAME -->`` and ``<!-- /generated: NAME -->``
  in bench/README.md, a pure function of one results file (``BLOCKS``): per machine
  kind a provenance line (dates, commits, load, the machine, versions, repeats,
  whether the variants are one run) and the table of medians (min-max of the
  repeats where they differ); then the file's ``checks``;
* a **number** between ``<!-- json:PATH#KEY SPEC -->`` and ``<!-- /json -->`` in
  bench/README.md, docs/DESIGN.md or README.md (``DOCS``): the value at ``KEY``
  (dot-separated; an integer indexes a list) of the JSON file ``PATH`` (from the
  repository root), formatted with the format spec ``SPEC`` (``.3f``, ``,.0f``,
  ``.0%``; optional; a leading ``/1024`` divides first).

Everything else is prose: it interprets, and a number it states by itself is
marked "by hand" (``tests/unit/test_prose_numbers.py``).

Comparisons are judged only within one run. A check that compares variants
(``COMPARISONS``) reads "not comparable" unless the file's variants are one run
(one clean commit, one machine, one sitting: ``bench.provenance.same_run``); a ratio
against a baseline is printed only where the two are one run. A table never mixes
machines: variants measured on different machine kinds get one table each. A
result recorded from a dirty tree is refused. ``tests/unit/test_bench_tables.py``
regenerates every block and fails on any difference.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench import machines, provenance
from bench.report import spread

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parent / "README.md"
#: the documents whose generated numbers ``main`` rewrites and checks
DOCS = (README, ROOT / "docs" / "DESIGN.md", ROOT / "README.md")

_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /generated: (?P=name) -->)", re.S)
#: ``<!-- json:PATH#KEY [/DIVISOR] [SPEC] -->TEXT<!-- /json -->``
NUMBER = re.compile(
    r"(?P<open><!-- json:(?P<path>[^#\s]+)#(?P<key>\S+)(?: /(?P<div>[\d.]+))?(?: (?P<spec>[^\s]+))? -->)"
    r"(?P<text>.*?)(?P<close><!-- /json -->)",
    re.S,
)

#: checks that compare variants (or, for eagle-ab, two commits): they read
#: "not comparable" unless those variants are one run (eagle-ab: one machine)
COMPARISONS = re.compile(
    r"^(routers_hit_rat(e|io)_(ratio|ok)"
    r"|partial_eagle_caches_as_partial|partial_caches_more_than_aligned"
    r"|placement_(worse_than_off|no_worse_ok)"
    r"|stack_vllm_(not_above|above_vllm)(_or_ideal)?"
    r"|retention_\w+"
    r"|(?!vllm_pd(_shipped)?_cached_share$)\w*vllm_pd\w*"
    r"|answers_cached_outputs_equal_nocache"
    r"|stack_vllm_ttft_(ratio|ok)|done_when"
    r"|batch_\d+_not_lower)$"
)
#: a check that says whether variants are one run: recomputed where the file's are not
SAME_RUN_CHECK = re.compile(r"^(\w+_)?same_run$")
#: blocks whose comparisons are between commits by design, on one machine
MACHINE_GATED = frozenset({"eagle-ab"})


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


def _machine_text(recs: list[dict[str, Any]]) -> str:
    """Each machine kind of ``recs`` with what the records say of it."""
    kinds: dict[str, dict[str, Any]] = {}
    for r in recs:
        kinds.setdefault(provenance.machine_kind(r.get("machine")), r.get("machine") or {})
    texts = []
    for kind, m in kinds.items():
        bits = [kind, "%s CPUs" % m.get("cpus", "?")]
        if m.get("torch_cpu_capability"):
            bits.append("torch CPU capability %s" % m["torch_cpu_capability"])
        if m.get("memory_gib"):
            bits.append("%s GiB" % m["memory_gib"])
        if m.get("kernel"):
            bits.append("kernel %s" % m["kernel"])
        texts.append(", ".join(bits))
    many = " (**%d machine kinds**)" % len(kinds) if len(kinds) > 1 else ""
    return "on " + " and ".join(texts) + many


def provenance_line(name: str, out: dict[str, Any], whole: dict[str, Any] | None = None) -> str:
    """Where the numbers of ``out`` come from, in one paragraph; whether the variants
    of ``whole`` (the file, where ``out`` is one machine kind's part) are one run."""
    recs = _records(out)
    if not recs:
        m = out.get("machine", {})
        return (
            "_`%s`: written %s at commit %s, before runs kept their provenance (no machine, dirty flag, load or"
            " versions recorded; one run, no repeats): a record, not a headline._\n"
            % (name, m.get("date") or m.get("written_utc", "?"), str(m.get("commit", "?"))[:7])
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
    parts = [
        "`%s`: run %s to %s, commit %s"
        % (name, span["started_utc"], span["ended_utc"], ", ".join(c[:7] for c in span["commits"])),
        "%s repeat%s%s"
        % ("/".join(map(str, counts)), "s" if counts != [1] else "", " per variant" if "variants" in out else ""),
        "load average (1 min) %.1f-%.1f" % (min(load), max(load)),
        _machine_text(recs),
        ", ".join("%s %s" % (k, "/".join(sorted(v))) for k, v in sorted(versions.items())),
    ]
    variants = (whole or out).get("variants")
    if isinstance(variants, dict) and len(variants) > 1:
        why = provenance.variants_difference(variants.values())
        parts.append("the variants are one run" if why is None else "the variants are **not** one run (%s)" % why)
    return "_" + "; ".join(parts) + "._\n"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "holds" if v else "**MISSED**"
    if isinstance(v, float):
        return "%.4g" % v
    if isinstance(v, list) and not v:
        return "none"
    return "`%s`" % json.dumps(v) if not isinstance(v, str) else v


def difference(name: str, out: dict[str, Any]) -> str | None:
    """None where the comparisons of block ``name``'s file may be judged (its
    variants are one run; eagle-ab: every record on one machine), else why not."""
    if isinstance(out.get("variants"), dict):
        return provenance.variants_difference(out["variants"].values())
    if name in MACHINE_GATED and not provenance.same_machine(_records(out)):
        return "not one machine"
    return None


def checks_lines(out: dict[str, Any], why: str | None = None) -> str:
    """The file's ``checks`` in one paragraph (a false check reads MISSED). Where the
    variants are not one run (``why``), a comparison reads "not comparable" and a
    ``same_run`` check says why it is missed."""
    checks = out.get("checks")
    if not checks:
        return ""
    items = []
    for k, v in checks.items():
        shown = _value(v)
        if why is not None and COMPARISONS.match(k):
            shown = provenance.NOT_COMPARABLE
        elif why is not None and SAME_RUN_CHECK.match(k):
            shown = "**MISSED** (%s)" % why
        items.append("`%s` %s" % (k, shown))
    head = "Checks (`checks` in the JSON, judged on the medians; per-request bounds in every repeat): "
    return "\n" + head + "; ".join(items) + ".\n"


def _vs_lines(out: dict[str, Any]) -> str:
    """Ratios of each variant against its baselines (growing streams' ``vs_*``),
    only where the two are one run."""
    rows, left = [], 0
    variants = out["variants"]
    for name, v in variants.items():
        for key, r in v.items():
            if not key.startswith("vs_"):
                continue
            base = variants.get(key[3:])
            if base is None or not provenance.variants_same_run([v, base]):
                left += 1
                continue
            rows.append(
                "| %s | %s | %.3f | %.3f | %.3f |"
                % (name, key[3:], r["recomputed_tokens"], r["ttft_p50"], r["throughput"])
            )
    out_lines = []
    if rows:
        out_lines += [
            "",
            "Against the baselines of the same run (ratios of the medians):",
            "",
            "| variant | baseline | recomputed tokens | TTFT p50 | throughput |",
            "|---|---|---|---|---|",
            *rows,
        ]
    if left:
        out_lines += ["", "%d ratios against a baseline left out: not one run (not comparable)." % left]
    return "\n".join(out_lines) + "\n" if out_lines else ""


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
    def cell(v: Any) -> str:  # counts as counts (the metric deltas are floats)
        whole = isinstance(v, int | float) and not isinstance(v, bool) and float(v).is_integer()
        return f"{int(v):,}" if whole else _value(v)

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


#: a GPU check's fields, in order, and their column names
GPU_FIELDS = (
    ("device", "device"),
    ("dtype", "dtype"),
    ("hit_tokens_per_warm_request", "hit tokens / warm request"),
    ("hit_tokens_ideal", "ideal"),
    ("eagle_mean_acceptance_length", "EAGLE acceptance length"),
    ("ttft_cold_p50_ms", "TTFT cold p50 ms"),
    ("ttft_warm_p50_ms", "TTFT warm p50 ms"),
    ("decode_tokens_per_s_warm_round", "decode tok/s"),
    ("greedy_equal_to_reference", "greedy equal to the reference"),
    ("pools_free_after", "pools free after"),
)


#: the GPU check's other results, one row each below the first file's
GPU_MORE = ("gpu_check_bfloat16.json",)


def _gpu_check(out: dict[str, Any], results: Path | None = None) -> str:
    """One row per dtype: this file's, then ``GPU_MORE``'s (each with its provenance line)."""
    results = results or RESULTS
    outs = [out] + [json.loads((results / f).read_text()) for f in GPU_MORE if (results / f).exists()]
    notes = [provenance_line(f, o) for f, o in zip(GPU_MORE, outs[1:], strict=False)]
    fields = [(k, h) for k, h in GPU_FIELDS if k in out]
    rows = ["| " + " | ".join(h for _, h in fields) + " |", "|" + "---|" * len(fields)]
    rows += ["| " + " | ".join(_value(o.get(k, "-")).strip("`") for k, _ in fields) + " |" for o in outs]
    return "".join(notes) + "\n" + "\n".join(rows) + "\n"


def _module_markdown(module: str) -> Callable[[dict[str, Any]], str]:
    def render(out: dict[str, Any]) -> str:
        import importlib

        text: str = importlib.import_module(module).markdown(out)
        return text

    return render


def _first_table(module: str) -> Callable[[dict[str, Any]], str]:
    """The module's markdown up to its first blank line (its main table)."""
    md = _module_markdown(module)
    return lambda out: md(out).split("\n\n", 1)[0].rstrip("\n") + "\n" + _notes(out)


def _dropping(module: str, *prefixes: str) -> Callable[[dict[str, Any]], str]:
    """The module's markdown without the paragraphs starting with ``prefixes`` (and,
    after such a paragraph ending in a colon, the table it introduces): detail the
    run's own ``.md`` keeps."""
    md = _module_markdown(module)

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


def _variants_table(module: str) -> Callable[[dict[str, Any]], str]:
    md = _module_markdown(module)
    return lambda out: md(out) + _vs_lines(out) + _notes(out)


def _shared_prefix(out: dict[str, Any]) -> str:
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


def _placement(out: dict[str, Any]) -> str:
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


#: block name -> (results file, table renderer); files without a block are listed by ``other-results``
BLOCKS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "growing-streams-quick": ("growing_streams_quick.json", _variants_table("bench.growing_streams")),
    "shared-prefix-quick": ("shared_prefix_quick.json", _shared_prefix),
    "shared-prefix-placement-quick": ("shared_prefix_placement_quick.json", _shared_prefix),
    "placement": ("placement.json", _placement),
    "multi-turn-quick": ("multi_turn_quick.json", _first_table("bench.multi_turn_run")),
    "overhead": ("overhead.json", _module_markdown("bench.overhead")),
    "vllm-client-pd-quick": ("vllm_client_pd_quick.json", _vllm_client),
    "vllm-client-pd": ("vllm_client_pd.json", _vllm_client),
    "router": ("router.json", _dropping("bench.router", "CPU time")),
    "serving-path-ab": ("ab-issue50.json", _module_markdown("bench.ab")),
    "index-scale": ("index_scale_quick.json", _dropping("bench.index_scale", "Encodings", "Ingestion")),
    "hashing": ("hashing.json", _module_markdown("bench.hashing")),
    "engine": ("engine.json", _dropping("bench.engine", "| k ")),
    "eagle-ab": ("eagle_ab.json", _module_markdown("bench.eagle_ab")),
    "state-plane": ("state_plane.json", _module_markdown("bench.state_plane")),
    "soak": ("soak.json", _soak),
    "vllm-index-promises": ("vllm_index_promises.json", _promises),
    "gpu-check": ("gpu_check_float32.json", _gpu_check),
    "other-results": ("", lambda out: ""),
    "machines": ("", lambda out: ""),
}


#: blocks whose module's ``markdown`` renders its checks itself (as a budget table)
RENDER_OWN_CHECKS = frozenset({"router", "overhead", "index-scale", "serving-path-ab"})


def _by_kind(out: dict[str, Any]) -> dict[str, list[str]]:
    """The variants of ``out`` by machine kind, in order (a variant measured on several
    kinds is a kind of its own; one without provenance takes the file's machine)."""
    fallback = provenance.machine_kind(out.get("machine") if isinstance(out.get("machine"), dict) else None)
    kinds: dict[str, list[str]] = {}
    for name, v in out["variants"].items():
        seen = sorted({provenance.machine_kind(r.get("machine")) for r in provenance.records_of(v)})
        kinds.setdefault(" + ".join(seen) if seen else fallback, []).append(name)
    return kinds


def render_block(name: str, results: Path = RESULTS) -> str:
    """The generated text of block ``name`` from its results file."""
    if name not in BLOCKS:
        raise KeyError("unknown generated block %r (known: %s)" % (name, ", ".join(BLOCKS)))
    filename, table = BLOCKS[name]
    if name == "other-results":
        return _others(results)
    if name == "machines":
        return machines.markdown(results)
    path = results / filename
    if not path.exists():
        return "_No results file `bench/results/%s` yet._\n" % filename
    out = json.loads(path.read_text())
    kinds = _by_kind(out) if isinstance(out.get("variants"), dict) else {"": []}
    parts = []
    for i, names in enumerate(kinds.values()):
        sub = out if len(kinds) == 1 else {**out, "variants": {n: out["variants"][n] for n in names}}
        parts.append(("\n" if i else "") + "%s\n%s" % (provenance_line(filename, sub, out), table(sub)))
    checks = "" if name in RENDER_OWN_CHECKS else checks_lines(out, difference(name, out))
    return "".join(parts) + checks


def _others(results: Path) -> str:
    """One line per results file no block tabulates: where it came from (its own
    ``.md`` beside it has its tables)."""
    shown = {f for f, _ in BLOCKS.values()} | set(GPU_MORE)
    lines = []
    for path in sorted(results.glob("*.json")):
        if path.name not in shown:
            line = provenance_line(path.name, json.loads(path.read_text())).rstrip("\n")
            lines.append("- %s" % line)
    return "\n".join(lines) + "\n" if lines else "_None._\n"


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every generated block replaced by its current rendering."""

    def sub(m: re.Match[str]) -> str:
        return m.group(1) + render_block(m.group("name"), results) + m.group(4)

    return _BLOCK.sub(sub, text)


def lookup(data: Any, key: str) -> Any:
    """The value at ``key`` (dot-separated; an integer indexes a list) of ``data``."""
    at = data
    for part in key.split("."):
        if isinstance(at, list) and re.fullmatch(r"-?\d+", part):
            at = at[int(part)]
        elif isinstance(at, Mapping) and part in at:
            at = at[part]
        else:
            raise KeyError("no %r in %r (at %r)" % (part, key, list(at) if isinstance(at, Mapping) else at))
    return at


def number(path: str, key: str, spec: str | None = None, div: float | None = None, root: Path = ROOT) -> str:
    """The text of one generated number: ``format(value / div, spec)``; a comparison
    that is not one run (``NOT_COMPARABLE``) stays that text."""
    value = lookup(json.loads((root / path).read_text()), key)
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None or not isinstance(value, int | float):
        raise TypeError("%s#%s is %r, not a number" % (path, key, value))
    return format(value / div if div else value, spec or "")


def render_numbers(text: str, root: Path = ROOT) -> str:
    """``text`` with every generated number replaced by its current value."""

    def sub(m: re.Match[str]) -> str:
        div = float(m.group("div")) if m.group("div") else None
        return m.group("open") + number(m.group("path"), m.group("key"), m.group("spec"), div, root) + m.group("close")

    return NUMBER.sub(sub, text)


def regenerate(path: Path, text: str, results: Path = RESULTS, root: Path = ROOT) -> str:
    """``text`` of the document ``path`` with its blocks (bench/README.md) and numbers regenerated."""
    return render_numbers(render(text, results) if path == README else text, root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 with a diff where a block or number differs")
    ap.add_argument("--readme", type=Path, default=None, help="only this document (its blocks and numbers)")
    args = ap.parse_args(argv)
    status = 0
    for doc in [args.readme] if args.readme else list(DOCS):
        old = doc.read_text()
        new = render_numbers(render(old)) if args.readme else regenerate(doc, old)
        if new == old:
            continue
        if args.check:
            sys.stdout.writelines(
                difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(doc), "generated")
            )
            status = 1
        else:
            doc.write_text(new)
            print("rewrote %s" % doc)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
