"""The variables vLLM reads while a vLLM engine is built are set for that build only
(``engine/vllm/environment.py``, #53): afterwards ``os.environ`` is exactly what it was,
variables unset before included, and MooncakeStoreConnector's config folder is gone
(no vLLM needed)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from hybridpd.engine.vllm import environment
from hybridpd.engine.vllm.environment import MANAGED, build_environment, scoped_environ


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the managed variables set (monkeypatch puts back what the process had)."""
    for name in MANAGED:
        monkeypatch.delenv(name, raising=False)


def test_scoped_environ_restores_the_environment_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDPD_TEST_KEPT", "before")
    monkeypatch.setenv("HYBRIDPD_TEST_UNSET", "before")
    monkeypatch.delenv("HYBRIDPD_TEST_NEW", raising=False)
    before = dict(os.environ)
    changes = {"HYBRIDPD_TEST_KEPT": "inside", "HYBRIDPD_TEST_UNSET": None, "HYBRIDPD_TEST_NEW": "inside"}
    with scoped_environ(changes):
        assert os.environ["HYBRIDPD_TEST_KEPT"] == "inside" and os.environ["HYBRIDPD_TEST_NEW"] == "inside"
        assert "HYBRIDPD_TEST_UNSET" not in os.environ
    assert dict(os.environ) == before
    with pytest.raises(RuntimeError), scoped_environ(changes):  # also when the build fails
        raise RuntimeError("vLLM refused")
    assert dict(os.environ) == before


def test_a_build_sees_vllms_variables_and_leaves_none_behind(clean: None, tmp_path: Path) -> None:
    before = dict(os.environ)
    store = {"master_server_address": "10.0.0.1:50061"}
    with build_environment(1 << 30, side_channel=True, mooncake=store):
        inside = {name: os.environ.get(name) for name in MANAGED}
        config = Path(os.environ["MOONCAKE_CONFIG_PATH"])
        assert json.loads(config.read_text()) == store
    assert dict(os.environ) == before
    assert not config.parent.exists()  # the config file's folder goes with the build
    assert inside["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and inside["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] == "0"
    assert inside["VLLM_CPU_KVCACHE_SPACE"] is None  # the space is an argument: vLLM's CPU platform must not replace it
    assert int(inside["VLLM_NIXL_SIDE_CHANNEL_PORT"] or 0) > 0 and inside["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    with pytest.raises(RuntimeError), build_environment(1 << 30, side_channel=False, mooncake=store):
        folder = Path(os.environ["MOONCAKE_CONFIG_PATH"]).parent
        raise RuntimeError("vLLM refused")
    assert dict(os.environ) == before and not folder.exists()


def test_a_build_keeps_the_side_channel_it_was_given_and_unsets_the_cpu_space(
    clean: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The local stack hands each actor its NIXL port; a ``VLLM_CPU_KVCACHE_SPACE`` in the
    environment is hidden from the build (and said so where it disagrees with the config)."""
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5999")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    before = dict(os.environ)
    with caplog.at_level(logging.WARNING, logger=environment.__name__):
        with build_environment(1 << 30, side_channel=True):
            assert os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5999"
            assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in os.environ
            assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ and "MOONCAKE_CONFIG_PATH" not in os.environ
    assert dict(os.environ) == before
    assert "VLLM_CPU_KVCACHE_SPACE=4 is not read" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=environment.__name__):
        with build_environment(4 << 30, side_channel=False):  # agrees: nothing to say
            pass
    assert caplog.text == ""
