"""The environment vLLM reads while a vLLM engine is built here, set for that build only.

vLLM reads some of its settings from variables, not arguments: its engine core in
this process, its KV space on CPU, its KV events' hash form, the NIXL side channel
and MooncakeStoreConnector's config file. :func:`build_environment` sets them around
the build (``LLMEngine.from_engine_args`` in ``core.py``) and puts the process's
environment back as it was when the build ends, so no engine leaves a variable
behind. The KV and state space itself is a config field
(``vllm_kv_cache_memory_bytes``, ``vllm_kv_cache_blocks``) that ``args.py`` passes as
arguments; only its default lives here.

Where vLLM reads each (vLLM 0.32; ``tests/vllm/test_environment.py`` fails where one
moves): ``VLLM_ENABLE_V1_MULTIPROCESSING``, ``VLLM_CPU_KVCACHE_SPACE`` and the NIXL
side channel while it builds its config and connectors; ``MOONCAKE_CONFIG_PATH`` once,
when the store worker starts (so the file's folder goes with the scope). NOTE:
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is read later, at request time (the block
pool, as it publishes events), through ``vllm.envs``; the engine core freezes
``vllm.envs`` at the end of its constructor (``enable_envs_cache``), inside the scope,
so the value set here holds for the engine's life without staying in ``os.environ``
(:func:`check_event_hashes` checks it after the build). That freeze is process-wide:
a second engine in one process reads what the first froze (our actors build one).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hybridpd.engine.vllm import adapter
from hybridpd.errors import StartupError
from hybridpd.procs import listen_ports

logger = logging.getLogger(__name__)

#: vLLM's KV and state space per engine by default (the default of ``vllm_kv_cache_memory_bytes``)
DEFAULT_KV_CACHE_BYTES = 1 << 30
#: vLLM's CPU platform replaces ``kv_cache_memory_bytes`` by this many GiB whenever it is set
CPU_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"
#: the variables :func:`build_environment` may set or unset (no others)
MANAGED = (
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    CPU_KV_SPACE,
    "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "MOONCAKE_CONFIG_PATH",
)


@contextmanager
def scoped_environ(changes: Mapping[str, str | None]) -> Iterator[None]:
    """Set each variable of ``changes`` to its value (None: unset it) inside the block;
    afterwards each is back as it was, unset again if it was unset (the rest of the
    environment is not touched)."""
    saved = {name: os.environ.get(name) for name in changes}
    try:
        for name, value in changes.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _cpu_kv_space_ignored(kv_cache_bytes: int) -> None:
    """Say so where the environment's ``VLLM_CPU_KVCACHE_SPACE`` disagrees with the config."""
    given = os.environ.get(CPU_KV_SPACE, "")
    agrees = kv_cache_bytes % (1 << 30) == 0 and given.strip() == str(kv_cache_bytes >> 30)
    if given and not agrees:
        logger.warning(
            "%s=%s is not read: vllm_kv_cache_memory_bytes (%d) sizes vLLM's KV and state space",
            CPU_KV_SPACE,
            given,
            kv_cache_bytes,
        )


@contextmanager
def build_environment(
    kv_cache_bytes: int, *, side_channel: bool, mooncake: Mapping[str, Any] | None = None
) -> Iterator[None]:
    """The variables vLLM reads while it builds one engine, set inside the block (module
    docstring): its engine core in this process, KV events with full block hashes (they
    equal our chain; unread without events), no ``VLLM_CPU_KVCACHE_SPACE`` (the space is
    ``kv_cache_bytes``, passed as an argument); with ``side_channel``, a NIXL side-channel
    port unless the environment names one (the local stack hands each actor its own;
    elsewhere one is chosen here, outside the ephemeral range); with ``mooncake``,
    MooncakeStoreConnector's config file, in a folder removed when the block ends."""
    _cpu_kv_space_ignored(kv_cache_bytes)
    changes: dict[str, str | None] = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        CPU_KV_SPACE: None,
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",
    }
    if side_channel and "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
        changes["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(listen_ports(1)[0])
        if "VLLM_NIXL_SIDE_CHANNEL_HOST" not in os.environ:
            changes["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    folder = tempfile.mkdtemp(prefix="hybridpd-mooncake-") if mooncake is not None else None
    try:
        if folder is not None:
            path = Path(folder) / "mooncake.json"
            path.write_text(json.dumps(dict(mooncake or {})))
            changes["MOONCAKE_CONFIG_PATH"] = str(path)
        with scoped_environ(changes):
            yield
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def check_event_hashes() -> None:
    """After a build with KV events: vLLM's frozen ``vllm.envs`` (module docstring) gives
    full block hashes; else StartupError (64-bit ints would match no hash of our chain)."""
    if adapter.event_hashes_are_ints():
        raise StartupError(
            "vLLM's KV events would carry 64-bit block hashes: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES was read"
            " as 1 (vllm.envs frozen before this engine's build, or no longer frozen by vLLM's engine core)"
        )
