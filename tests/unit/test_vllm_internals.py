"""The vLLM engine refuses a vLLM release it was not written for, and names any
internal it reads that vLLM lacks, instead of turning a feature off silently (#53)."""

from __future__ import annotations

import types

import pytest

from hybridpd.engine.vllm.adapter import check_version, require
from hybridpd.errors import StartupError

pytestmark = pytest.mark.unit


def test_only_the_supported_release_starts() -> None:
    check_version("0.32.0")
    check_version("0.32.1+cpu")
    for other in ("0.33.0", "0.31.2", "1.0.0"):
        with pytest.raises(StartupError, match="vLLM %s is not supported" % other):
            check_version(other)


def test_a_missing_internal_is_named_not_guessed() -> None:
    sched = types.SimpleNamespace(use_eagle_block_drop=False)
    assert require(sched, "use_eagle_block_drop", "Scheduler") is False  # a False value is a value
    with pytest.raises(StartupError, match=r"no Scheduler\.mamba_partial_cache_hit"):
        require(sched, "mamba_partial_cache_hit", "Scheduler")
    with pytest.raises(StartupError, match=r"no EngineCore\.scheduler"):
        require(None, "scheduler", "EngineCore")
