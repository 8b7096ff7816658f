"""``hybridpd bench`` commands of the serving path: ``overhead`` (the stack against
the engine in-process), ``vllm-client`` (``vllm bench serve`` against the stack and
vLLM), ``ab`` (before and after a commit) and ``soak`` (a bounded soak).

Contract: each command imports its benchmark when it runs, writes the JSON at
``--json`` and prints what it measured; ``soak`` exits 1 when its checks fail.
"""

from __future__ import annotations

import click

from bench.cli_options import json_option, repeats_option


def _latency_row(a: str, b: str, values: tuple[float, ...]) -> None:
    """One line of a latency table: TTFT p50/p99, ITL p50/p99 (ms), output tokens/s."""
    numbers = "TTFT p50 %8.1f p99 %8.1f ms   ITL p50 %6.2f p99 %6.2f ms   %7.1f tok/s" % values
    click.echo("%-13s %-21s %s" % (a, b, numbers))


@click.command("overhead")
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


@click.command("vllm-client")
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


@click.command("ab")
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


@click.command("soak")
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


#: the commands ``bench.cli`` adds to ``hybridpd bench``
COMMANDS = (bench_overhead, bench_vllm_client, bench_ab, bench_soak)
