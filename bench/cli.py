"""``hybridpd bench ...``: the benchmark commands.

A plugin of the ``hybridpd`` command line (``launch/cli.py`` adds every
command of the ``hybridpd.cli`` entry-point group, pyproject.toml), so the
benchmarks may start stacks through ``launch`` without ``launch`` importing
them. The commands live in modules by benchmark family (``caching_commands``,
``index_commands``, ``serving_commands``, ``eagle_commands``); each imports its
benchmark when it runs.
"""

from __future__ import annotations

import click

from bench import caching_commands, eagle_commands, index_commands, serving_commands


@click.group()
def bench() -> None:
    """Benchmarks (JSON + PNG; growing-streams also a markdown table)."""


for _family in (caching_commands, index_commands, serving_commands, eagle_commands):
    for _command in _family.COMMANDS:
        bench.add_command(_command)
