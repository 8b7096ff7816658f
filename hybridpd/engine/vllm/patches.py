"""Process-wide adjustments for vLLM's engine running inside our actors.

Two let it sit idle without spinning on a CPU, one keeps it from pinning itself to
one core, one keeps its store puts in its own store segment. All are applied by
``VllmEngine`` while it builds its engine; they change vLLM's defaults, not its
behaviour (see each docstring for why nothing is lost). The vLLM symbols they rebind
or read are resolved through ``adapter.py``; each has a test that fails when vLLM or
torch moves it (``tests/vllm/test_patch_targets.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hybridpd.engine.vllm import adapter

logger = logging.getLogger(__name__)


def nixl_without_progress_thread() -> None:
    """vLLM's NixlConnector creates its agent with NIXL's UCX progress thread, which the
    Python API runs with no delay: a free spin, ~40-60% of a core per idle engine on CPU.
    Its agent is created without it (a keyword default on vLLM's config factory). Nothing
    is lost: the connector drives NIXL from every engine step (``get_new_notifs`` and
    ``check_xfer_state`` progress the workers), and our engine loop steps a prefill engine
    while its KV waits for decode's read (``has_work``), a decode engine while it loads."""
    make = adapter.nixl_agent_config()
    if make is None:  # NIXL's Python API is not installed: no NIXL agent, no thread
        return
    if isinstance(make, functools.partial) and make.keywords.get("enable_prog_thread") is False:
        return  # patched already
    adapter.set_nixl_agent_config(functools.partial(make, enable_prog_thread=False))


@contextmanager
def one_gloo_device() -> Iterator[None]:
    """While vLLM builds its engine here, all its gloo process groups share one gloo device.

    vLLM makes ~15 gloo groups even at world size 1 (world, TP, PP, DP, EP, ... each a
    device group and a CPU group); torch gives each its own device, and each device its own
    event-loop thread that wakes every 10 ms: ~1% of a core for an idle engine. One device
    serves any number of groups (gloo pairs share its loop), so: one loop thread."""
    from torch.distributed import distributed_c10d as c10d

    # NOTE: a default: torch (not vLLM) is built with or without gloo, within a supported release
    base: Any = getattr(c10d, "ProcessGroupGloo", None)
    if base is None:  # torch without gloo
        yield
        return
    device: list[Any] = []

    class SharedDeviceGloo(base):
        def __init__(self, store: Any, rank: int, size: int, timeout: Any = None) -> None:
            if not device:
                device.append(base.create_default_device())
            opts = base._Options()
            opts._devices = device[:1]
            if timeout is not None:
                opts._timeout = timeout
            super().__init__(store, rank, size, opts)

    setattr(c10d, "ProcessGroupGloo", SharedDeviceGloo)  # noqa: B010 (mypy: a module's class)
    try:
        yield
    finally:
        setattr(c10d, "ProcessGroupGloo", base)  # noqa: B010


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")} if os.path.isdir("/proc/self/task") else set()


@contextmanager
def kept_cpu_affinity() -> Iterator[None]:
    """The CPUs the building thread may run on are the same after vLLM builds its engine.

    vLLM's NixlConnector worker on a CPU moves the calling thread to the last core of
    each NUMA node (``os.sched_setaffinity(0, ...)`` in ``NixlConnectorWorker.__init__``:
    in ``vllm serve`` its OpenMP threads, bound before, run the forward elsewhere and
    that thread only moves KV). In our actors the engine runs in-process on the thread
    that built it and on the threads created after (the engine loop, OpenMP's pool), so
    every prefill and decode engine of a machine would compute on that one core. The
    building thread, and the threads started meanwhile that inherited the pin, get the
    CPUs they had back (what Ray, the container or the operator gave the actor)."""
    # NOTE: defaults: the os module has no affinity calls on some platforms (macOS); not vLLM's
    get, put = getattr(os, "sched_getaffinity", None), getattr(os, "sched_setaffinity", None)
    if get is None or put is None:
        yield
        return
    before, threads = get(0), _threads()
    try:
        yield
    finally:
        pinned = get(0)
        if pinned != before:
            logger.info("vLLM pinned its engine to CPUs %s: given back %s", sorted(pinned), sorted(before))
            put(0, before)
            for tid in _threads() - threads:
                try:
                    if get(tid) == pinned:
                        put(tid, before)
                except OSError:  # the thread ended meanwhile
                    continue


def store_puts_to_own_segment() -> str | None:
    """vLLM's MooncakeStoreConnector in this process writes its puts into this
    process's own store segment. Returns that segment's name; None without a store
    connector. A segment an operator chose (vLLM's ``preferred_segment``, e.g.
    ``MOONCAKE_PREFERRED_SEGMENT``) is kept.

    Left to Mooncake, a put lands in any mounted segment: on a machine with several
    prefill engines, often another engine's, over the transfer engine (TCP here).
    The putting process then copies the bytes out and the owner copies them in,
    while both engines compute. A prefix is written once, by the engine that
    computed it, and read only when a request misses that engine's local cache. So
    the write stays local and the rare read crosses. The name is known only once
    the store is set up (its port is chosen then), so it is set on the connector's
    ``ReplicateConfig`` after vLLM builds the engine.
    ``tests/vllm/test_patch_targets.py`` fails where vLLM moves a field read here."""
    worker = adapter.store_worker()
    if worker is None:
        return None
    configs = adapter.store_put_configs(worker)
    if configs[0].preferred_segment:  # Mooncake's ReplicateConfig: "" unless set
        return str(configs[0].preferred_segment)
    name = adapter.store_segment(worker)
    for config in configs:  # the put thread's ReplicateConfig is mostly the worker's own
        config.preferred_segment = name
    logger.info("vLLM's store puts go to this engine's own segment %s", name)
    return name
