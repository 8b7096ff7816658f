"""docs/DESIGN.md names every module: its layout section lists each source
module of every package directory (and nothing that is gone), and its
request-flow table names every router file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DESIGN = (ROOT / "docs" / "DESIGN.md").read_text()
#: directories whose modules the layout lists (generated code excluded)
SOURCE_DIRS = ("hybridpd", "services", "launch", "bench", "scripts")


def _layout() -> dict[str, set[str]]:
    """Directory -> the module names the layout block lists for it."""
    block = DESIGN[DESIGN.index("Layout: four layers") :]
    block = block[block.index("```\n") + 4 :]
    block = block[: block.index("```")]
    listed: dict[str, set[str]] = {}
    current = None
    for line in block.splitlines():
        line = re.sub(r"\(.*?\)|\(.*$", "", line)  # notes in parentheses
        words = line.split()
        if not words:
            continue
        if not line.startswith(" ") and words[0].endswith("/"):
            current, words = words[0].rstrip("/"), words[1:]
        elif line.startswith(" ") and current is not None:
            pass
        else:
            current = None
            continue
        listed.setdefault(current, set()).update(w for w in words if not w.endswith("/"))
    return listed


def _modules() -> dict[str, set[str]]:
    have: dict[str, set[str]] = {}
    for top in SOURCE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if path.name == "__init__.py" or "v1" in rel.parts:
                continue
            have.setdefault(str(rel.parent), set()).add(path.stem)
    return have


def test_the_layout_names_every_module_and_no_other() -> None:
    listed, have = _layout(), _modules()
    missing = {d: sorted(m - listed.get(d, set())) for d, m in have.items() if m - listed.get(d, set())}
    stale = {d: sorted(m - have.get(d, set())) for d, m in listed.items() if d in have and m - have.get(d, set())}
    assert not missing, "modules docs/DESIGN.md's layout does not name: %s" % missing
    assert not stale, "names in docs/DESIGN.md's layout with no module: %s" % stale


def test_the_request_flow_table_names_every_router_file() -> None:
    section = DESIGN[DESIGN.index("## 3. Request flow") :]
    table = section[: section.index("\n\n", section.index("| step |"))]
    files = sorted(p.name for p in (ROOT / "services" / "router").glob("*.py") if p.name != "__init__.py")
    missing = [f for f in files if f not in table]
    assert not missing, "router files the request-flow table does not name: %s" % missing
