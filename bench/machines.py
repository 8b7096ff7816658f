"""Which machine every results file was measured on: bench/README.md's ``machines`` block.

One row per JSON file directly under ``bench/results/``: the machine kinds its
provenance records name (``bench.provenance.machine_kind``: the CPU model with the
kernel-picking flags), its commits and when it ran. A file whose records do not
name their CPU flags, or that has no provenance at all, reads so in its row:
``tests/unit/test_bench_machines.py`` fails on such a file, so none is committed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import provenance


def records(out: Any) -> list[dict[str, Any]]:
    """Every provenance record anywhere in a results file (a dict with a ``commit``
    under a ``provenance`` key, or in a list there)."""
    found: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            p = x.get("provenance")
            found.extend(r for r in (p if isinstance(p, list) else [p]) if isinstance(r, dict) and "commit" in r)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(out)
    return found


def unnamed(path: Path) -> str | None:
    """Why ``path``'s records do not name their machine's CPU features (None: they all do)."""
    recs = records(json.loads(path.read_text()))
    if not recs:
        return "no provenance"
    if not all(provenance.has_machine(r) for r in recs):
        return "a record names no CPU flags"
    return None


def row(path: Path) -> str:
    """The table row of one results file."""
    recs = records(json.loads(path.read_text()))
    why = unnamed(path)
    if why is not None:
        return "| `%s` | **%s** | | |" % (path.name, why)
    span = provenance.span(recs)
    when = span["started_utc"][:10] if span["started_utc"] else "?"
    return "| `%s` | %s | %s | %s |" % (
        path.name,
        "; ".join(span["machine_kinds"]),
        ", ".join(c[:7] for c in span["commits"]),
        when,
    )


def markdown(results: Path) -> str:
    """The ``machines`` block: one row per results file, by name."""
    files = sorted(results.glob("*.json"))
    if not files:
        return "_No results files._\n"
    lines = ["| file | machine kind | commits | date (UTC) |", "|---|---|---|---|", *map(row, files)]
    return "\n".join(lines) + "\n"
