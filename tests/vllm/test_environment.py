"""vLLM reads the variables ``hybridpd/engine/vllm/environment.py`` sets where that
module expects, so setting them for the engine's build only is enough (#53).

Read from the installed vLLM, no engine is built: each variable is read while the
engine is built (its config, its connectors' constructors), or, for the KV events'
hash form, at request time through ``vllm.envs``, which the engine core freezes at the
end of its constructor. A release that moves a read fails here instead of silently
reading the variable after the build put the environment back. (That the environment
is unchanged after an engine is built and closed: ``test_cpu_affinity.py``.)
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


def test_the_build_time_variables_are_read_while_vllm_builds_its_engine() -> None:
    from vllm.distributed import mooncake_store
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.engine.llm_engine import LLMEngine

    # in-process engine core: when the engine is made from its arguments (and by the CPU platform's config)
    assert "envs.VLLM_ENABLE_V1_MULTIPROCESSING" in inspect.getsource(LLMEngine.from_engine_args)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" in inspect.getsource(CpuPlatform.check_and_update_config)
    # the CPU platform replaces kv_cache_memory_bytes by VLLM_CPU_KVCACHE_SPACE while it builds the config
    assert '"VLLM_CPU_KVCACHE_SPACE"' in inspect.getsource(CpuPlatform.check_and_update_config)
    # the NIXL side channel: the connector's scheduler side, in its constructor
    init = inspect.getsource(NixlBaseConnectorScheduler.__init__)
    assert "envs.VLLM_NIXL_SIDE_CHANNEL_PORT" in init and "envs.VLLM_NIXL_SIDE_CHANNEL_HOST" in init
    # MooncakeStoreConnector's config file: read once, by the store worker's constructor
    assert "MOONCAKE_CONFIG_PATH" in inspect.getsource(mooncake_store.MooncakeStoreConfig.load_from_config)
    assert "load_from_config()" in inspect.getsource(worker.MooncakeStoreWorker.__init__)
    assert inspect.getsource(worker).count("load_from_config(") == 1


def test_the_event_hash_form_is_frozen_by_the_engine_core_during_the_build() -> None:
    """``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is read at request time through
    ``vllm.envs``; ``EngineCore.__init__`` freezes ``vllm.envs``, so a value set for the
    build holds after it (``environment.check_event_hashes``), and without the freeze
    the check refuses to start. Run in a fresh process: the freeze is process-wide."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine.core import EngineCore

    assert "envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES" in inspect.getsource(kv_cache_utils.maybe_convert_block_hash)
    assert "enable_envs_cache()" in inspect.getsource(EngineCore.__init__)
    code = (
        "import os\n"
        "from vllm import envs\n"
        "from hybridpd.engine.vllm.environment import build_environment, check_event_hashes\n"
        "from hybridpd.errors import StartupError\n"
        "os.environ.pop('VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES', None)\n"
        "try:\n"
        "    check_event_hashes()\n"
        "    raise SystemExit('unfrozen and unset: vLLM would use int hashes, and the check passed')\n"
        "except StartupError:\n"
        "    pass\n"
        "with build_environment(1 << 30, side_channel=False):\n"
        "    envs.enable_envs_cache()  # what EngineCore.__init__ does at the end of the build\n"
        "assert 'VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES' not in os.environ\n"
        "check_event_hashes()\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-2000:]
