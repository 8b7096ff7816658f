"""``hybridpd bench`` commands of the routing decision and the prefix index:
``router`` (decision latency against vLLM's block hashing) and ``index-scale``
(the index at cluster scale).

Contract: each command imports its benchmark when it runs, writes the JSON (and
PNG, markdown) at ``--json`` and prints what it measured.
"""

from __future__ import annotations

import click

from bench.cli_options import QUICK_OPTION, json_option, repeats_option, workload_json_option


@click.command("router")
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


@click.command("index-scale")
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


#: the commands ``bench.cli`` adds to ``hybridpd bench``
COMMANDS = (bench_router, bench_index_scale)
