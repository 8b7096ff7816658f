"""``hybridpd bench`` commands of EAGLE: ``eagle`` (decode tokens/s with and
without it, bench/engine.py) and ``eagle-ab`` (its speedup before and after a
commit, bench/eagle_ab.py).

Contract: each command hands its options to its benchmark's ``main``, which
writes the JSON at ``--json``.
"""

from __future__ import annotations

import click

from bench.cli_options import json_option


@click.command("eagle")
@json_option("engine")
@click.option("--quick", is_flag=True)
def bench_eagle(json_path: str, quick: bool) -> None:
    """Decode tokens/s with and without EAGLE, and the mean acceptance length."""
    from bench import engine

    engine.main(["--json", json_path] + (["--quick"] if quick else []))


@click.command("eagle-ab")
@json_option("eagle_ab")
@click.option("--before", default=None, help="Commit to compare against: run the interleaved A/B first.")
@click.option("--runs", type=click.IntRange(min=1), default=8, show_default=True, help="bench eagle runs per side.")
def bench_eagle_ab(json_path: str, before: str | None, runs: int) -> None:
    """EAGLE's speedup before and after a commit: interleaved bench eagle runs, pooled repeats."""
    from bench import eagle_ab

    eagle_ab.main(["--json", json_path, "--runs", str(runs)] + (["--before", before] if before else []))


#: the commands ``bench.cli`` adds to ``hybridpd bench``
COMMANDS = (bench_eagle, bench_eagle_ab)
