"""``hybridpd bench`` commands of the caching workloads: growing streams, shared
prefixes, placement replay and multi-turn chat (cached tokens against the ideal).

Contract: each command imports its benchmark when it runs, writes the JSON (and
PNG, markdown) at ``--json`` and prints the markdown table, checks and notes;
a ``--quick`` run writes ``<name>_quick.json`` unless ``--json`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import click

from bench.cli_options import QUICK_OPTION, REPEATS_OPTION, workload_json_option


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


@click.command("growing-streams")
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


@click.command("shared-prefix")
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


@click.command("placement")
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


@click.command("multi-turn")
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


#: the commands ``bench.cli`` adds to ``hybridpd bench``
COMMANDS = (bench_growing_streams, bench_shared_prefix, bench_placement, bench_multi_turn)
