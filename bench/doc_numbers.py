"""The generated numbers of the docs: ``<!-- json:PATH#KEY [/DIVISOR] [SPEC] -->TEXT<!-- /json -->``.

A number between the markers is the value at ``KEY`` (dot-separated; an integer
indexes a list) of the JSON file ``PATH`` (from the repository root), formatted
with the format spec ``SPEC`` (``.3f``, ``,.0f``, ``.0%``; optional; a leading
``/1024`` divides first). ``render_numbers`` rewrites every such number from its
file; ``tests/unit/test_prose_numbers.py`` fails where one differs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: ``<!-- json:PATH#KEY [/DIVISOR] [SPEC] -->TEXT<!-- /json -->``
NUMBER = re.compile(
    r"(?P<open><!-- json:(?P<path>[^#\s]+)#(?P<key>\S+)(?: /(?P<div>[\d.]+))?(?: (?P<spec>[^\s]+))? -->)"
    r"(?P<text>.*?)(?P<close><!-- /json -->)",
    re.S,
)


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
