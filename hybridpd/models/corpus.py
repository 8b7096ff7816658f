"""English text that is on every machine without a download: the docstrings of
this Python's standard library (PSF License 2.0) and of four pinned runtime
dependencies installed by ``scripts/bootstrap.sh`` (:data:`PACKAGES`: numpy
BSD-3-Clause, pydantic MIT, click BSD-3-Clause, jinja2 BSD-3-Clause).

The tiny model is trained on it (``scripts/train_tiny.py``) and evaluated on
a held-out part of the stdlib (``hybridpd.models.perplexity``). The
split is by source file: a stdlib file is held out when the sha256 of its path relative to the
stdlib starts with a byte < ``HELDOUT_BYTES`` (about 1 in 16 files), so
the same files are held out on every machine.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sysconfig
from collections.abc import Iterator
from functools import cache
from pathlib import Path

HELDOUT_BYTES = 16  # of 256: ~6% of the files
SKIP_PARTS = {"test", "tests", "testing", "site-packages", "idle_test", "__pycache__"}
#: Pinned in requirements/runtime.txt; training text only (never held out).
PACKAGES = ("numpy", "pydantic", "click", "jinja2")


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                yield doc


def is_heldout(rel: str) -> bool:
    return hashlib.sha256(rel.encode()).digest()[0] < HELDOUT_BYTES


@cache
def documents() -> tuple[tuple[str, str], ...]:
    """``(relative path, docstring)`` for every stdlib module, sorted by path."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, str]] = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if SKIP_PARTS & set(path.relative_to(stdlib).parts):
            continue
        out.extend((rel, d) for d in _docstrings(path))
    return tuple(out)


@cache
def package_documents() -> tuple[tuple[str, str], ...]:
    """``(package/relative path, docstring)`` for :data:`PACKAGES` (those installed)."""
    out: list[tuple[str, str]] = []
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if SKIP_PARTS & set(rel.parts):
                continue
            out.extend(("%s/%s" % (pkg, rel.as_posix()), d) for d in _docstrings(path))
    return tuple(out)


def train_texts(packages: bool = True) -> list[str]:
    """Training text: the stdlib's non-held-out docstrings, then the packages'."""
    out = [d for rel, d in documents() if not is_heldout(rel)]
    if packages:
        out.extend(d for _, d in package_documents())
    return out


def heldout_texts() -> list[str]:
    return [d for rel, d in documents() if is_heldout(rel)]
