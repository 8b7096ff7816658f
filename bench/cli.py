# Over 350 lines: one thin click command per benchmark.
"""``hybridpd bench ...``: the benchmark commands.

A plugin of the ``hybridpd`` command line (``launch/cli.py`` adds every
command of the ``hybridpd.cli`` entry-point group, pyproject.toml), so the
benchmarks may start stacks through ``launch`` without ``launch`` importing
them. Each command imports its benchmark when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def repeats_option(default: int, help: str) -> Callable[[F], F]:
    """``--repeats`` (bench/repeats.py: every repeat kept, medians published)."""
    return click.option("--repeats", type=click.IntRange(min=1), default=default, show_default=True, help=help)


def json_option(name: str) -> Callable[[F], F]:
    """``--json PATH``, by default ``bench/results/<name>.json``."""
    return click.option(
        "--json",
        "json_path",
        type=click.Path(dir_okay=False),
        default="bench/results/%s.json" % name,
        show_default=True,
    )


def workload_json_option(stem: str) -> Callable[[F], F]:
    """``--json PATH`` of a workload benchmark: ``<stem>.json``, ``<stem>_quick.json`` with ``--quick``."""
    return click.option(
        "--json",
        "json_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="Where to write [default: bench/results/%s.json; with --quick, %s_quick.json]" % (stem, stem),
    )


QUICK_OPTION = click.option("--quick", is_flag=True, help="A smaller workload that finishes in minutes.")

#: ``--repeats`` of the benchmarks with variants (interleaved)
REPEATS_OPTION = repeats_option(
    3, "Run each variant this many times, interleaved; the JSON keeps every repeat and the tables show medians."
)


@click.group()
def bench() -> None:
    """Benchmarks (JSON + PNG; growing-streams also a markdown table)."""


def _workload_overrides(fields: Iterable[str], items: Iterable[str]) -> dict[str, int]:
    """``--workload FIELD=INT`` options as overrides of a benchmark's Workload fields."""
    names = list(fields)
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in names or not value.isdigit():
            raise click.BadParameter("expected FIELD=INT with FIELD one of %s, got %r" % (", ".join(names), item))
        out[key] = int(value)
    return out


def _echo_report(json_path: str, out: dict[str, Any]) -> None:
    """Print a benchmark's markdown table, its checks and notes, and where it wrote them."""
    from pathlib import Path

    click.echo(Path(json_path).with_suffix(".md").read_text())
    click.echo("checks: %s" % out["checks"])
    for name, note in out.get("notes", {}).items():
        click.echo("%s: %s" % (name, note))
    click.echo("wrote %s (+ .png, .md)" % json_path)


@bench.command("growing-streams")
@workload_json_option("growing_streams")
@QUICK_OPTION
@click.option("--url", default=None, help="Run against a running stack instead of starting one per variant.")
@click.option(
    "--variant",
    "variants",
    multiple=True,
    help="Run only these variants (partial, aligned, nocache, roundrobin, partial_eagle, aligned_eagle,"
    " partial-4routers, vllm-direct, vllm-pd, vllm-partial) and merge them into the same workload's results"
    " already in --json."
    " vllm-* need the vLLM environment (make bootstrap-vllm); vllm-pd is vLLM's own prefill/decode setup.",
)
@click.option(
    "--workload",
    "workload",
    multiple=True,
    metavar="FIELD=INT",
    help="Override the workload: streams, start, step, end, max_tokens, unit, mamba_block_size, seed"
    " (e.g. --workload start=120000 --workload end=164000 --workload step=2000 --workload unit=128).",
)
@REPEATS_OPTION
def bench_growing_streams(
    json_path: str | None,
    quick: bool,
    url: str | None,
    variants: tuple[str, ...],
    workload: tuple[str, ...],
    repeats: int,
) -> None:
    """Long prompts growing every round, in several caching/routing variants."""
    from pathlib import Path

    from bench import growing_streams

    if json_path is None:  # a --quick run never overwrites the full run's results
        json_path = "bench/results/growing_streams_quick.json" if quick else "bench/results/growing_streams.json"

    overrides = _workload_overrides(growing_streams.Workload.__dataclass_fields__, workload)
    out = growing_streams.run(Path(json_path), quick, url, list(variants) or None, overrides, repeats)
    _echo_report(json_path, out)


@bench.command("shared-prefix")
@workload_json_option("shared_prefix")
@QUICK_OPTION
@click.option(
    "--variant",
    "variants",
    multiple=True,
    type=click.Choice(
        [
            "tail-only",
            "branch-aware",
            "branch-aware-placement-off",
            "branch-aware-4routers",
            "nocache",
            "stack-vllm",
            "stack-vllm-retain-dense",
            "stack-vllm-1p1d",
            "stack-vllm-no-tail-stage",
            "stack-vllm-no-store",
            "vllm-direct",
            "vllm-pd",
            "vllm-pd-shipped",
        ]
    ),
    help="Run only these variants and merge them into the same workload's results already in --json"
    " (stack-vllm, our stack on the vLLM engine, stack-vllm-retain-dense, the same with vLLM's retention"
    " interval at its scheduler block, stack-vllm-1p1d, the same with one prefill actor,"
    " stack-vllm-no-tail-stage, the same without the P/D tail stage, stack-vllm-no-store, the same"
    " without vLLM's MooncakeStore connector,"
    " vllm-direct and vllm-pd[-shipped], vLLM's own prefill/decode setup with NIXL's progress thread off"
    " [as vLLM ships it], need the vLLM environment: make bootstrap-vllm).",
)
@click.option(
    "--workload",
    "workload",
    multiple=True,
    metavar="FIELD=INT",
    help="Override the workload (bench/shared_prefix.py Workload: conversations, system_tokens, ...,"
    " unit, mamba_block_size, seed), e.g. --workload mamba_block_size=16.",
)
@REPEATS_OPTION
def bench_shared_prefix(
    json_path: str | None, quick: bool, variants: tuple[str, ...], workload: tuple[str, ...], repeats: int
) -> None:
    """Fan-out, agent-tree, multi-turn and two-sharer prompts: cached tokens against the ideal, per checkpoint
    policy (branch-aware-placement-off: branch-aware without checkpoint placement; branch-aware-4routers:
    branch-aware through 4 routers sharing the index and the actors)."""
    from pathlib import Path

    from bench import shared_prefix, shared_prefix_run

    if json_path is None:  # a --quick run never overwrites the full run's results
        json_path = "bench/results/shared_prefix_quick.json" if quick else "bench/results/shared_prefix.json"
    overrides = _workload_overrides(shared_prefix.Workload.__dataclass_fields__, workload)
    out = shared_prefix_run.run(Path(json_path), quick, list(variants) or None, overrides, repeats)
    _echo_report(json_path, out)


@bench.command("placement")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    default="bench/results/placement.json",
    show_default=True,
    help="Where to write.",
)
@click.option("--checkpoints", default=2, show_default=True, help="placement_checkpoints of value and geometric.")
@click.option(
    "--min-gain", default=0.05, show_default=True, type=click.FloatRange(0, 1), help="placement_min_gain of value."
)
def bench_placement(json_path: str, checkpoints: int, min_gain: float) -> None:
    """Replay fan-out, tree, two-sharer and growing-stream prompts through the placement policies (tensor-free,
    seconds): hit ratio and state bytes of value, geometric, tail+junction and fixed intervals."""
    import dataclasses
    from pathlib import Path

    from bench import placement

    r = dataclasses.replace(placement.Replay(), placement_checkpoints=checkpoints, placement_min_gain=min_gain)
    out = placement.run(Path(json_path), r)
    _echo_report(json_path, out)


@bench.command("multi-turn")
@workload_json_option("multi_turn")
@QUICK_OPTION
@click.option(
    "--variant",
    "variants",
    multiple=True,
    type=click.Choice(
        [
            "answers-cached",
            "prompt-only",
            "nocache",
            "vllm-direct",
            "vllm-pd",
            "vllm-pd-shipped",
            "stack-vllm",
            "stack-vllm-prompt-only",
            "stack-vllm-1p1d",
        ]
    ),
    help="Run only these variants and merge them into the same workload's results already in --json"
    " (stack-vllm[-prompt-only], our stack on the vLLM engine with answer checkpoints on [off],"
    " stack-vllm-1p1d, the same with one prefill engine, vllm-direct and vllm-pd[-shipped], vLLM's own"
    " prefill/decode setup with NIXL's progress thread off [as vLLM ships it], need the vLLM environment:"
    " make bootstrap-vllm).",
)
@click.option(
    "--workload",
    "workload",
    multiple=True,
    metavar="FIELD=INT",
    help="Override the workload (bench/multi_turn.py Workload: users, rounds, system_tokens, message_tokens_min,"
    " message_tokens_max, answer_tokens, think_ms, unit, mamba_block_size, seed), e.g. --workload answer_tokens=256.",
)
@REPEATS_OPTION
def bench_multi_turn(
    json_path: str | None, quick: bool, variants: tuple[str, ...], workload: tuple[str, ...], repeats: int
) -> None:
    """Multi-round chat (LMCache's multi-round QA shape): recomputed prompt tokens against the
    ideal per round, with and without answer checkpoints."""
    from pathlib import Path

    from bench import multi_turn, multi_turn_run

    if json_path is None:  # a --quick run never overwrites the full run's results
        json_path = "bench/results/multi_turn_quick.json" if quick else "bench/results/multi_turn.json"
    overrides = _workload_overrides(multi_turn.Workload.__dataclass_fields__, workload)
    out = multi_turn_run.run(Path(json_path), quick, list(variants) or None, overrides, repeats)
    _echo_report(json_path, out)


@bench.command("router")
@json_option("router")
@repeats_option(5, "Complete measurements; the JSON keeps every one, the tables and the budget use their median.")
@click.option(
    "--iterations", type=click.IntRange(min=1), default=300, show_default=True, help="Decisions per size and repeat."
)
@click.option("--copy", "copy", is_flag=True, help="Time the copy of vLLM's hash_block_tokens even where vLLM imports.")
def bench_router(json_path: str, repeats: int, iterations: int, copy: bool) -> None:
    """Router decision latency (hash chain + one index lookup + choice) for 16K and 164K-token
    prompts at unit 128, against vLLM's own block hashing of the same tokens, interleaved.

    Run from the vLLM environment (.venv-vllm/bin/hybridpd bench router) the baseline is vLLM's
    get_request_block_hasher over a vllm Request; where vLLM does not import, a copy of its
    hash_block_tokens loop, labelled so. Budget: median over repeats of the 164K-token
    decision p99 / baseline p50 <= 0.1. Writes JSON, PNG and a markdown table.
    """
    from pathlib import Path

    from bench import router, vllm_chain

    out = router.run(Path(json_path), iterations=iterations, repeats=repeats, allow_vllm=not copy)
    name = vllm_chain.label(out["baseline"])
    for size, r in out["results"].items():
        click.echo(
            "%s: p50 %.2f ms, p99 %.2f ms (%d blocks; chain %.2f, lookup %.2f); %s p50 %.1f ms: p99 %.3fx"
            " (medians of %d)"
            % (
                size,
                r["p50_ms"],
                r["p99_ms"],
                r["blocks"],
                r["chain_p50_ms"],
                r["lookup_p50_ms"],
                name,
                r["baseline_p50_ms"],
                r["ratio_p99_vs_baseline"],
                out["repeat_count"],
            )
        )
    click.echo("baseline: %s" % out["baseline"])
    click.echo("checks: %s" % out["checks"])
    click.echo("wrote %s (+ .png, .md)" % json_path)


def _latency_row(a: str, b: str, values: tuple[float, ...]) -> None:
    """One line of a latency table: TTFT p50/p99, ITL p50/p99 (ms), output tokens/s."""
    numbers = "TTFT p50 %8.1f p99 %8.1f ms   ITL p50 %6.2f p99 %6.2f ms   %7.1f tok/s" % values
    click.echo("%-13s %-21s %s" % (a, b, numbers))


@bench.command("overhead")
@json_option("overhead")
@click.option("--quick", is_flag=True, help="Fewer requests per concurrency level.")
@repeats_option(
    3, "Complete measurements (one stack); the JSON keeps every one, the tables and budgets use their median."
)
@click.option("--prompt-tokens", default=1024, show_default=True, type=click.IntRange(16, 8192))
@click.option("--output-tokens", default=32, show_default=True, type=click.IntRange(2, 1024))
@click.option(
    "--model", default="tiny", show_default=True, help="Bundled native model (tiny, tiny-random) or a directory."
)
@click.option(
    "--integrity/--no-integrity",
    default=True,
    show_default=True,
    help="Also time keyed integrity's work (per handoff, token frame, store checkpoint) on this workload, with"
    " and without the key, against the stack's TTFT (target: at most 5% per handoff).",
)
def bench_overhead(
    json_path: str, quick: bool, repeats: int, prompt_tokens: int, output_tokens: int, model: str, integrity: bool
) -> None:
    """TTFT, ITL and TPOT of the engine in-process vs through the stack (1 prefill + 1 decode), same run.

    ITL per token as the client receives it (a k-token chunk: one gap, then k - 1 zeros), TPOT per
    request ((last token - first token) / (tokens - 1)); vLLM's per-chunk ITL beside them.
    Budgets on the medians: stack TTFT p50 <= engine's + 25 ms (concurrency 1), stack ITL p50 and
    TPOT p50 <= 1.3x the engine's (concurrency 1 and 4). Writes JSON, PNG and a markdown table.
    """
    from pathlib import Path

    from bench import overhead

    out = overhead.run(Path(json_path), quick, prompt_tokens, output_tokens, model, repeats, integrity)
    click.echo(overhead.markdown(out))
    click.echo("wrote %s (+ .png, .md)" % json_path)


@bench.command("vllm-client")
@json_option("vllm_client")
@click.option("--quick", is_flag=True, help="8 prompts per run instead of 32.")
@repeats_option(3, "Start and measure each target this many times, interleaved; the JSON keeps every repeat.")
@click.option(
    "--target",
    "targets",
    multiple=True,
    type=click.Choice(
        [
            "stack-native",
            "stack-vllm",
            "stack-vllm-1p1d",
            "stack-vllm-1p1d-no-placement",
            "vllm-direct",
            "vllm-pd",
            "vllm-pd-shipped",
        ]
    ),
    help="Run only these targets (repeatable; default: all).",
)
def bench_vllm_client(json_path: str, quick: bool, repeats: int, targets: tuple[str, ...]) -> None:
    """`vllm bench serve` against the stack (native; vLLM engine, 2+1 and 1+1 actors), plain `vllm serve`
    and vLLM's own P/D."""
    from pathlib import Path

    from bench import vllm_client

    out = vllm_client.run(Path(json_path), quick, repeats, targets)
    for target, r in out["variants"].items():
        for name in out["workloads"]:
            keys = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")
            _latency_row(target, name, tuple(float(r[name][k] if r[name][k] is not None else "nan") for k in keys))
    for k, v in out["checks"].items():
        click.echo("%s: %s" % (k, v))
    click.echo("medians of %d repeats; wrote %s" % (repeats, json_path))


@bench.command("eagle")
@json_option("engine")
@click.option("--quick", is_flag=True)
def bench_eagle(json_path: str, quick: bool) -> None:
    """Decode tokens/s with and without EAGLE, and the mean acceptance length."""
    from bench import engine

    engine.main(["--json", json_path] + (["--quick"] if quick else []))


@bench.command("eagle-ab")
@json_option("eagle_ab")
@click.option("--before", default=None, help="Commit to compare against: run the interleaved A/B first.")
@click.option("--runs", type=click.IntRange(min=1), default=8, show_default=True, help="bench eagle runs per side.")
def bench_eagle_ab(json_path: str, before: str | None, runs: int) -> None:
    """EAGLE's speedup before and after a commit: interleaved bench eagle runs, pooled repeats."""
    from bench import eagle_ab

    eagle_ab.main(["--json", json_path, "--runs", str(runs)] + (["--before", before] if before else []))


@bench.command("ab")
@json_option("ab")
@click.option("--before", default=None, help="Commit to compare against: run the interleaved A/B first.")
@click.option("--runs", type=click.IntRange(min=1), default=2, show_default=True, help="Runs of each bench per side.")
@repeats_option(2, "Repeats inside each run.")
@click.option(
    "--bench",
    "benches",
    multiple=True,
    type=click.Choice(["overhead", "router"]),
    default=("overhead", "router"),
    show_default=True,
)
def bench_ab(json_path: str, before: str | None, runs: int, repeats: int, benches: tuple[str, ...]) -> None:
    """The serving path's cost before and after a commit: interleaved bench overhead and router runs."""
    from pathlib import Path

    from bench import ab

    out = ab.main(before, runs, repeats, list(benches), Path(json_path))
    click.echo(ab.markdown(out))


@bench.command("index-scale")
@workload_json_option("index_scale")
@QUICK_OPTION
@repeats_option(3, "Complete measurements (fresh Redis each); the JSON keeps every one, tables show medians.")
@click.option(
    "--levels",
    default=None,
    help="Membership counts to measure at, comma-separated [default: 100000,1000000,3000000,10000000;"
    " with --quick 100000,300000,1000000].",
)
@click.option("--rates", default=None, help="Ingestion rates (events/s) of the ladder, comma-separated.")
@click.option("--unit", type=click.IntRange(min=1), default=128, show_default=True, help="Tokens per block.")
@click.option(
    "--iterations", type=click.IntRange(min=10), default=200, show_default=True, help="Decisions per size and level."
)
@click.option(
    "--budget-factor",
    type=click.FloatRange(min=1.0),
    default=2.0,
    show_default=True,
    help="Ingestion keeps the 164K decision p99 within this factor of its idle value.",
)
def bench_index_scale(
    json_path: str | None,
    quick: bool,
    repeats: int,
    levels: str | None,
    rates: str | None,
    unit: int,
    iterations: int,
    budget_factor: float,
) -> None:
    """The prefix index at cluster scale: a real Redis and lookup.lua, 64 instances, up to 10M
    memberships. Decision p50/p99 at 1K/16K/164K tokens per index size, Redis memory per
    membership and CPU per lookup and per event, the sustained ingestion rate within budget,
    and the memory of alternative encodings. Writes JSON, PNG and a markdown table."""
    from pathlib import Path

    from bench import index_scale

    def ints(text: str | None) -> tuple[int, ...] | None:
        if text is None:
            return None
        try:
            got = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError as exc:
            raise click.BadParameter("comma-separated integers expected, got %r" % text) from exc
        if not got or min(got) < 1:
            raise click.BadParameter("positive integers expected, got %r" % text)
        return got

    path = Path(json_path or "bench/results/index_scale%s.json" % ("_quick" if quick else ""))
    out = index_scale.run(
        path, quick, repeats, ints(levels), ints(rates), unit=unit, iterations=iterations, budget_factor=budget_factor
    )
    click.echo(index_scale.markdown(out))
    click.echo("wrote %s (+ .png, .md)" % path)


@bench.command("soak")
@json_option("soak")
@click.option("--minutes", type=click.FloatRange(min=0.05), default=10.0, show_default=True, help="How long to run.")
@click.option("--streams", type=click.IntRange(min=1), default=16, show_default=True, help="Concurrent client streams.")
@click.option("--url", default=None, help="Soak a running stack instead of starting one.")
def bench_soak(json_path: str, minutes: float, streams: int, url: str | None) -> None:
    """Bounded soak: concurrent mixed requests with shared prefixes; failures, pools, RSS."""
    from pathlib import Path

    from bench import soak

    out = soak.run(Path(json_path), soak.SoakConfig(minutes=minutes, streams=streams), url)
    click.echo(
        "soak: %d ok, %d failed, %d inconsistent, pools back to baseline: %s, %.1f req/s, TTFT p50 %.0f ms"
        % (
            out["requests_ok"],
            out["requests_failed"],
            out["inconsistent_outputs"],
            out["pools_back_to_baseline"],
            out["requests_per_s"],
            out["ttft_p50_ms"],
        )
    )
    if out.get("reference") is not None:
        click.echo(
            "no-cache reference: %d of %d sampled answers differ (fp32 rows batch-invariant here: %s)"
            % (out["reference_mismatches"], out["reference_sampled"], out["reference_row_invariant"])
        )
    click.echo(
        "RSS growth after warm-up (MiB): %s" % {k: round(v, 1) for k, v in out["rss_growth_mb_after_warmup"].items()}
    )
    click.echo("checks: %s" % out["checks"])
    click.echo("wrote %s (+ .png)" % json_path)
    if not out["checks"]["ok"]:
        raise SystemExit(1)
