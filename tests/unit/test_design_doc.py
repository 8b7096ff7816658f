"""docs/DESIGN.md stays the design of record: short enough to read (at most
:data:`MAX_LINES` lines) and free of history (no commit references, no dated
entries); git and bench/README.md keep those."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
#: the most lines docs/DESIGN.md may hold
MAX_LINES = 600

#: a 7-40 digit hex word in backticks, or after "commit": what a commit reference looks like
_HEX = r"[0-9a-fA-F]{7,40}"
COMMIT_REF = re.compile(r"`(%s)`|\bcommits?\b\W{0,3}(%s)\b" % (_HEX, _HEX), re.I)
#: a calendar date, 2026-12-02
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def commit_refs(text: str) -> list[str]:
    """The commit-hash-like references of ``text``: hex words with a digit and a letter."""
    found = []
    for m in COMMIT_REF.finditer(text):
        word = m.group(1) or m.group(2)
        if re.search(r"\d", word) and re.search(r"[a-fA-F]", word):
            found.append(word)
    return found


def test_the_design_is_at_most_600_lines() -> None:
    lines = DESIGN.read_text().count("\n")
    assert lines <= MAX_LINES, "docs/DESIGN.md has %d lines (at most %d): cut narrative, point to bench/README.md" % (
        lines,
        MAX_LINES,
    )


def test_the_design_names_no_commit() -> None:
    refs = commit_refs(DESIGN.read_text())
    assert not refs, "docs/DESIGN.md names commits (history belongs in git): %s" % refs


def test_the_design_has_no_dated_entries() -> None:
    dates = DATE.findall(DESIGN.read_text())
    assert not dates, "docs/DESIGN.md has dated entries (history belongs in git): %s" % dates


def test_the_scanner_finds_commit_references() -> None:
    assert commit_refs("ran at `2ae876f`, and at commit 8db1f1e, after commit: 617adb2f") == [
        "2ae876f",
        "8db1f1e",
        "617adb2f",
    ]
    # not commits: all digits, all letters, too short, or a plain word
    assert commit_refs("`1234567`, `deadbeef`, `ab12`, commit 3600 s, `lookup.lua`, a1b2c3d4 alone") == []
