"""The options the ``hybridpd bench`` commands share: ``--json``, ``--quick``
and ``--repeats`` (``bench.cli``; each command module applies them).

Contract: each factory returns a click decorator; the defaults and help texts
are those ``hybridpd bench <command> --help`` shows.
"""

from __future__ import annotations

from collections.abc import Callable
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
