"""vLLM is reached in one adapter file (#53): ``hybridpd/engine/vllm/adapter.py``.

Read from the source (ast: code, not comments or docstrings), so no other file of
``hybridpd/``, ``services/``, ``launch/`` or ``bench/`` imports vLLM (function-level
imports included) or reaches into its engine (``engine_core``, the scheduler's
``kv_cache_manager`` and ``block_pool``, a connector's ``connector_scheduler`` and
``connector_worker``); and no file of ``engine/vllm/`` reads an attribute with a
default unless a NOTE says why. bench's vLLM baselines (its hashing chain, ``vllm serve``
run in-process) go through the adapter too. Runs without vLLM installed."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hybridpd", "services", "launch", "bench")
ADAPTER = "hybridpd/engine/vllm/adapter.py"
#: the attributes that reach into vLLM's engine (an attribute read, or a name getattr is given)
INTERNALS = frozenset({"engine_core", "kv_cache_manager", "block_pool", "connector_scheduler", "connector_worker"})


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def violations(source: str) -> list[str]:
    """What in ``source`` imports vLLM or reaches an engine internal, by line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += ["%d: import %s" % (node.lineno, a.name) for a in node.names if _is_vllm(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module or ""):
            found.append("%d: from %s import" % (node.lineno, node.module))
        elif isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            found.append("%d: .%s" % (node.lineno, node.attr))
        elif isinstance(node, ast.Call) and node.args:
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if name in ("getattr", "hasattr", "setattr", "require") and INTERNALS.intersection(strings):
                found.append("%d: %s(..., %r)" % (node.lineno, name, sorted(INTERNALS.intersection(strings))[0]))
            elif name in ("import_module", "__import__") and any(_is_vllm(s) for s in strings[:1]):
                found.append("%d: %s(%r)" % (node.lineno, name, strings[0]))
    return sorted(found, key=lambda v: int(v.split(":")[0]))


def _sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if "v1" not in p.relative_to(ROOT).parts]


def test_the_checker_reads_code_not_prose() -> None:
    code = (
        '"""import vllm; core.engine_core"""\n'
        "# from vllm import envs; x.kv_cache_manager\n"
        "def f(eng):\n"
        "    import vllm.envs\n"
        "    from vllm.v1.request import Request\n"
        "    pool = eng.engine_core.scheduler.kv_cache_manager.block_pool\n"
        "    return getattr(eng, 'connector_worker', None), importlib.import_module('vllm.envs')\n"
    )
    assert {v.split(": ", 1)[1] for v in violations(code)} == {
        "import vllm.envs",
        "from vllm.v1.request import",
        ".engine_core",
        ".kv_cache_manager",
        ".block_pool",
        "getattr(..., 'connector_worker')",
        "import_module('vllm.envs')",
    }
    assert violations("import vllmx\nfrom hybridpd.engine.native.block_pool import BlockPool\n") == []


def test_only_the_adapter_reaches_vllm() -> None:
    found = {}
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        if rel == ADAPTER:
            continue
        got = violations(path.read_text())
        if got:
            found[rel] = got
    assert not found, "vLLM reached outside %s: %s" % (ADAPTER, found)


def test_the_adapter_imports_without_vllm() -> None:
    """vLLM is imported inside the adapter's functions, so the engine package imports
    (and its unit tests run) where vLLM is not installed."""
    tree = ast.parse((ROOT / ADAPTER).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n.lineno for n in top if violations(ast.unparse(n))]
    had_vllm = "vllm" in sys.modules
    import hybridpd.engine.vllm.adapter as adapter
    import hybridpd.engine.vllm.engine  # noqa: F401 (the engine package, vLLM not imported)

    assert adapter.SUPPORTED and callable(adapter.check_installed)
    assert had_vllm or "vllm" not in sys.modules


def test_no_vllm_read_defaults_without_a_note() -> None:
    """``getattr(obj, name, default)`` in ``engine/vllm/`` only where a NOTE on its line
    or the one above says why the attribute may be absent (not on vLLM's objects: those
    are read directly or through ``adapter.require``)."""
    unexplained = []
    for path in sorted((ROOT / "hybridpd/engine/vllm").glob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                if len(node.args) > 2 and not any("NOTE" in lines[i] for i in (node.lineno - 2, node.lineno - 1)):
                    unexplained.append("%s:%d" % (path.name, node.lineno))
    assert not unexplained, unexplained
