"""The top-level packages form layers: hybridpd <- services <- launch <- bench.

Read from the source (every ``import`` and ``from ... import``, function-level
ones included), so a lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hybridpd", "services", "launch", "bench")


def _imports() -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> the files with such an import."""
    edges: dict[tuple[str, str], list[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in PACKAGES and top != pkg:
                        edges.setdefault((pkg, top), []).append(str(path.relative_to(ROOT)))
    return edges


def test_no_two_top_level_packages_import_each_other() -> None:
    edges = _imports()
    cycles = {(a, b): (edges[(a, b)], edges[(b, a)]) for a, b in edges if (b, a) in edges and a < b}
    assert not cycles, cycles


def test_each_package_imports_only_the_layers_below_it() -> None:
    rank = {pkg: i for i, pkg in enumerate(PACKAGES)}
    upward = {edge: files for edge, files in _imports().items() if rank[edge[1]] > rank[edge[0]]}
    assert not upward, upward


def _modules_imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_engines_sit_below_the_bundled_models() -> None:
    """``hybridpd/models/`` (building, text, evaluation) uses the native engine's
    parts; no engine module imports it back, except the factory, which resolves a
    model directory for the engine it builds (the composition root)."""
    back = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "hybridpd" / "engine").rglob("*.py"))
        if path.name != "factory.py" and any(m.startswith("hybridpd.models") for m in _modules_imported(path))
    ]
    assert not back, back


def test_the_native_engine_holds_tensors_only_in_its_runner() -> None:
    """After nano-vllm: the scheduler, the sequence, the step's messages and the
    cache bookkeeping are tensor-free; tensors live in the runner and its parts."""
    native = ROOT / "hybridpd" / "engine" / "native"
    tensor_free = (
        *("scheduler", "scheduler_config", "sequence", "step", "state_cache", "block_pool", "prefix_cache"),
        *("handoff_pins", "prefill_plan"),
    )
    with_torch = [name for name in tensor_free if "torch" in _modules_imported(native / ("%s.py" % name))]
    assert not with_torch, with_torch


def test_the_bench_commands_join_the_cli_as_a_plugin() -> None:
    from click.testing import CliRunner

    from launch.cli import cli

    res = CliRunner().invoke(cli, ["bench", "--help"])
    assert res.exit_code == 0, res.output
    assert "placement" in res.output and "shared-prefix" in res.output


#: no source file of these packages runs past this many lines (docs/DESIGN.md, Style)
MAX_LINES = 400
LIMITED = ("hybridpd", "services", "launch")


def test_no_source_file_runs_past_400_lines() -> None:
    """Small files named after things (docs/DESIGN.md, Style): no source file of
    hybridpd/, services/ or launch/ runs past ``MAX_LINES`` lines or opens with a
    ``# Over 350 lines:`` waiver (generated code aside; bench/: the test below)."""
    long, waived = [], []
    for pkg in LIMITED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "v1" in rel.parts:  # generated
                continue
            text = path.read_text()
            if text.count("\n") > MAX_LINES:
                long.append("%s (%d lines)" % (rel, text.count("\n")))
            if text.startswith("# Over 350 lines: "):
                waived.append(str(rel))
    assert not long, long
    assert not waived, "waiver headers: %s" % waived


def test_a_script_over_350_lines_says_why_at_its_top() -> None:
    """scripts/ keeps the older rule: a file over 350 lines opens with ``# Over 350 lines: <why>.``"""
    long = []
    for path in (ROOT / "scripts").rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 350 and not text.startswith("# Over 350 lines: "):
            long.append("%s (%d lines)" % (path.relative_to(ROOT), text.count("\n")))
    assert not long, long


#: the most lines a bench/ source file may hold (docs/DESIGN.md, Style)
BENCH_MAX_LINES = 400


def test_no_bench_file_runs_past_400_lines() -> None:
    """bench/ holds small files named after things too: none runs past
    ``BENCH_MAX_LINES`` lines or opens with a ``# Over 350 lines:`` waiver."""
    long, waived = [], []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        if text.count("\n") > BENCH_MAX_LINES:
            long.append("%s (%d lines)" % (rel, text.count("\n")))
        if text.startswith("# Over 350 lines: "):
            waived.append(rel)
    assert not long, long
    assert not waived, "waiver headers in bench/: %s" % waived
