"""What a vLLM engine sets in its process's environment before vLLM starts:
vLLM reads these variables, not arguments (its KV space on CPU, its KV-event
hashes, the NIXL side channel, MooncakeStoreConnector's config file), and two
of ours size the engines the workers build.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from hybridpd.config import HybridPDConfig
from hybridpd.engine.vllm.args import mooncake_config
from hybridpd.errors import ConfigError
from hybridpd.procs import listen_ports

#: vLLM's KV and state space per engine unless the caller names one
DEFAULT_KV_CACHE_BYTES = 1 << 30
#: the environment variable that overrides it for engines built by the workers (not a config
#: field: tests and benchmarks shrink the space so that prompts evict each other)
KV_CACHE_BYTES_ENV = "HYBRIDPD_VLLM_KV_CACHE_MEMORY_BYTES"
#: the same in pages (vLLM's ``num_gpu_blocks_override``): a page's bytes depend on the CPU
#: (vLLM 0.32's pages of the tiny Qwen3-Next: 640 tokens, 320 KiB on an AMD EPYC with
#: AVX512-BF16; 384 tokens, 192 KiB on one without), a page count does not
KV_CACHE_BLOCKS_ENV = "HYBRIDPD_VLLM_KV_CACHE_BLOCKS"


def kv_cache_bytes(cfg: HybridPDConfig, given: int | None) -> int:
    """vLLM's KV and state space: ``given``, else ``$HYBRIDPD_VLLM_KV_CACHE_MEMORY_BYTES``,
    else 1 GiB; on CPU, ``VLLM_CPU_KVCACHE_SPACE`` made to agree with it."""
    space = given if given is not None else int(os.environ.get(KV_CACHE_BYTES_ENV) or DEFAULT_KV_CACHE_BYTES)
    if cfg.device == "cpu":
        if space % (1 << 30):
            # vLLM's CPU platform replaces kv_cache_memory_bytes by VLLM_CPU_KVCACHE_SPACE (whole
            # GiB) whenever that is set: a space below or between GiB needs it unset
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(space >> 30))
    return space


def kv_cache_blocks(given: int | None) -> int | None:
    """That space in pages: ``given``, else ``$HYBRIDPD_VLLM_KV_CACHE_BLOCKS``, else None
    (by bytes); ConfigError for a count below 1."""
    if given is None and os.environ.get(KV_CACHE_BLOCKS_ENV):
        given = int(os.environ[KV_CACHE_BLOCKS_ENV])
    if given is not None and given < 1:
        raise ConfigError("engine", "%s must be a positive page count" % KV_CACHE_BLOCKS_ENV)
    return given


def in_process(events: bool) -> None:
    """vLLM's engine core in this process; with ``events``, KV events carrying full
    block hashes (they equal our chain)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if events:
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"


def nixl_side_channel() -> None:
    """One NIXL side channel per engine process: the local stack hands each actor its
    own port in its environment; elsewhere one is chosen here, outside the ephemeral range."""
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(listen_ports(1)[0])
        os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")


def mooncake_config_dir(master: str, metadata_url: str) -> str:
    """Write MooncakeStoreConnector's config file into a new folder and point
    ``MOONCAKE_CONFIG_PATH`` at it; returns the folder (the caller removes it)."""
    folder = tempfile.mkdtemp(prefix="hybridpd-mooncake-")
    path = Path(folder) / "mooncake.json"
    path.write_text(json.dumps(mooncake_config(master, metadata_url)))
    os.environ["MOONCAKE_CONFIG_PATH"] = str(path)
    return folder
