"""Engine profiles (``hybridpd/engine/profile.py``): pure data, what each engine
does as configured, and the one place (with ``engine/factory.py``) that names
an engine: nothing else in ``hybridpd/`` or ``services/`` compares the
``engine`` field."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest

from hybridpd.config import HybridPDConfig, load_config
from hybridpd.engine.profile import (
    FEATURE_DOCS,
    PROFILES,
    CheckpointGeometry,
    Feature,
    profile_of,
    support_table,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _profile(**over: Any) -> Any:
    return profile_of(load_config(env={}, overrides=over))


# -- (a) pure data -----------------------------------------------------------------------------
def test_the_profile_module_imports_neither_torch_nor_vllm() -> None:
    """The router reads profiles: importing them (and the config they read) must
    not pull in an engine's heavy dependencies."""
    code = (
        "import sys\n"
        "import hybridpd.engine.profile\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr


# -- (b) the profiles --------------------------------------------------------------------------
def test_every_engine_the_config_names_has_a_profile() -> None:
    assert set(PROFILES) == set(get_args(HybridPDConfig.model_fields["engine"].annotation))
    assert set(FEATURE_DOCS) == set(Feature)


def test_native_profile() -> None:
    p = _profile(prefix_match_unit=16, mamba_block_size=64, checkpoint_alignment=32)
    assert p.name == "native"
    assert p.geometry == CheckpointGeometry(16, 64, 32)
    assert (p.prefill_backoff, p.extra_checkpoints, p.staged) == (0, "snapshot", False)
    assert (p.delta_handoffs, p.imports_checkpoints, p.store_entries_unreported_evictions) == (True, True, False)
    assert (p.default_dtype, p.speculative_methods, p.auto_cpu_split) == ("float32", frozenset({"eagle"}), False)
    assert not p.supports(Feature.STRUCTURED_OUTPUTS) and p.supports(Feature.LOGPROBS)
    # the native draft head is attention-free: an EAGLE hit is a plain hit in every role
    eagle = _profile(eagle=True)
    assert not any(eagle.eagle_drop(role) for role in ("local", "prefill", "decode"))


def test_vllm_profile() -> None:
    p = _profile(engine="vllm", prefix_match_unit=16, mamba_block_size=64)  # checkpoint_alignment: unread
    assert p.name == "vllm"
    assert p.geometry == CheckpointGeometry(16, 16, 16)  # staged prefixes: any unit multiple
    assert (p.prefill_backoff, p.extra_checkpoints, p.staged) == (1, "staged", True)
    assert (p.delta_handoffs, p.imports_checkpoints, p.store_entries_unreported_evictions) == (False, False, True)
    assert p.features == frozenset(Feature)
    methods = get_args(HybridPDConfig.model_fields["speculative_method"].annotation)
    assert (p.default_dtype, p.speculative_methods, p.auto_cpu_split) == ("bfloat16", frozenset(methods), True)
    assert _profile(engine="vllm", device="cuda").default_dtype == "auto"  # the model's own


@pytest.mark.parametrize("eagle", [False, True])
def test_on_vllm_only_an_engine_with_a_drafter_drops_the_eagle_block(eagle: bool) -> None:
    """A vLLM P/D prefill engine runs no drafter (``args.speculative_config`` is None
    for role prefill), so its hits are plain ones; decode and a local engine run
    the drafter, whose hits replay the last block (docs/DESIGN.md, "Where EAGLE
    replays")."""
    p = _profile(engine="vllm", eagle=eagle)
    assert (p.eagle_drop_prefill, p.eagle_drop_decode) == (False, eagle)
    assert (p.eagle_drop("prefill"), p.eagle_drop("decode"), p.eagle_drop("local")) == (False, eagle, eagle)


def test_the_config_reads_the_profiles() -> None:
    assert load_config(env={}, overrides={"engine": "vllm", "dtype": "float32"}).engine_dtype() == "float32"
    assert load_config(env={}, overrides={"engine": "vllm"}).engine_dtype() == "bfloat16"
    assert load_config(env={}).engine_dtype() == "float32"
    assert load_config(env={}, overrides={"engine": "vllm"}).cpu_split()
    assert not load_config(env={}).cpu_split()


# -- (c) the rule: no engine branches outside the profile and the factory ----------------------
#: ``<x>.engine`` (or a bare ``engine``) compared with an engine's name, either way round,
#: by ==, !=, in or not in
ENGINE_BRANCH = re.compile(
    r"""\bengine\s*(?:==|!=)\s*["'](?:native|vllm)["']"""
    r"""|["'](?:native|vllm)["']\s*(?:==|!=)\s*[\w.]*\bengine\b(?!\w)"""
    r"""|\bengine\s+(?:not\s+)?in\s*[(\[{][^)\]}]*["'](?:native|vllm)["']"""
)
#: the files allowed to name an engine: the composition root and the profiles
ALLOWED = {Path("hybridpd/engine/factory.py"), Path("hybridpd/engine/profile.py")}


def _engine_branches() -> list[tuple[Path, int, str]]:
    found = []
    for top in ("hybridpd", "services"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel in ALLOWED:
                continue
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if ENGINE_BRANCH.search(line):
                    found.append((rel, no, line.strip()))
    return found


@pytest.mark.parametrize(
    "line",
    [
        'if cfg.engine == "vllm":',
        "x = self.cfg.engine != 'native'",
        'staged = "vllm" == cfg.engine',
        'if engine in ("native", "vllm"):',
        'ok = cfg.engine not in ["vllm"]',
    ],
)
def test_the_rule_sees_an_engine_branch(line: str) -> None:
    assert ENGINE_BRANCH.search(line)


@pytest.mark.parametrize(
    "line",
    ['if role == "prefill":', "engine = make_engine(cfg, role)", 'p = PROFILES["vllm"]', "if profile.staged:"],
)
def test_the_rule_passes_what_is_no_engine_branch(line: str) -> None:
    assert not ENGINE_BRANCH.search(line)


def test_no_engine_branch_outside_the_profile_and_the_factory() -> None:
    """Engine policy lives in ``engine/profile.py``: the router, placement and the
    workers read ``profile_of(cfg)``; only ``engine/factory.py`` (which engine to
    build) and ``launch/`` (how to start it) name the engine."""
    found = _engine_branches()
    assert not found, "read the engine's profile instead (hybridpd/engine/profile.py): %s" % found


# -- (d) the README's table --------------------------------------------------------------------
BEGIN, END = "<!-- engine-support:begin -->", "<!-- engine-support:end -->"


def test_the_readme_holds_the_support_table() -> None:
    """The README's table of what each engine supports is ``support_table()``'s
    (regenerate it with ``python -m hybridpd.engine.profile``)."""
    text = (ROOT / "README.md").read_text()
    if BEGIN not in text or END not in text:
        pytest.skip("README.md has no %s ... %s markers yet (the table is added with them)" % (BEGIN, END))
    got = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert got == support_table(), "regenerate it: python -m hybridpd.engine.profile"
