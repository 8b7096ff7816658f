"""Each symbol ``hybridpd/engine/vllm/patches.py`` rebinds or reads is where it expects it.

The patches change vLLM's and torch's defaults, not their behaviour; a release that
moves one of these names would make a patch silently do nothing. One test per patch
fails instead (read from the installed packages, no engine is built). The vLLM symbols
are resolved as the patches resolve them, through ``engine/vllm/adapter.py``.
"""

from __future__ import annotations

import functools
import inspect

import pytest

pytest.importorskip("vllm")


def test_nixl_without_progress_thread_finds_the_agent_config_factory() -> None:
    """``nixl_without_progress_thread`` rebinds ``base_worker.nixl_agent_config`` with
    ``enable_prog_thread=False``: the name, the factory's keyword and the worker's call."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    from hybridpd.engine.vllm import adapter

    make = adapter.nixl_agent_config()  # a StartupError where base_worker has no such name
    assert make is not None, "NIXL's Python API is not installed in the vLLM environment"
    assert make is base_worker.nixl_agent_config
    assert "enable_prog_thread" in inspect.signature(make).parameters
    assert "nixl_agent_config(" in inspect.getsource(base_worker)  # read at call time, from the module
    try:  # the rebinding lands where the worker reads it
        adapter.set_nixl_agent_config(functools.partial(make, enable_prog_thread=False))
        assert base_worker.nixl_agent_config.keywords == {"enable_prog_thread": False}
    finally:
        base_worker.nixl_agent_config = make


def test_one_gloo_device_finds_gloos_process_group_and_options() -> None:
    """``one_gloo_device`` subclasses ``distributed_c10d.ProcessGroupGloo`` and gives it one
    device through ``_Options._devices``."""
    from torch.distributed import distributed_c10d as c10d

    gloo = c10d.ProcessGroupGloo
    assert callable(gloo.create_default_device)
    opts = gloo._Options()
    opts._devices = []
    assert hasattr(opts, "_timeout")


def test_kept_cpu_affinity_guards_the_pin_nixl_sets() -> None:
    """``kept_cpu_affinity`` restores what the NixlConnector worker's ``sched_setaffinity``
    takes: the call it guards against is still there (without it the guard is inert)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    assert "os.sched_setaffinity(0" in inspect.getsource(base_worker)


def test_store_puts_to_own_segment_finds_the_store_workers_fields() -> None:
    """``store_puts_to_own_segment`` reads (``adapter.store_worker``, ``store_put_configs``,
    ``store_segment``) the transfer group, a multi-connector's ``sub_connectors``, the store
    connector's ``connector_worker`` and that worker's ``store``, ``store_replicate_config``
    and ``kv_send_thread.replicate_config``; the lookup (``adapter.store_scheduler``) the
    scheduler side's ``connector_scheduler``, ``client`` and ``enable_lookup``."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import connector, scheduler, worker
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.v1.core.sched.scheduler import Scheduler

    from hybridpd.engine.vllm import adapter

    assert callable(kv_transfer_state.get_kv_transfer_group) and callable(kv_transfer_state.has_kv_transfer_group)
    assert adapter.store_worker() is None  # no transfer group in this process
    assert isinstance(inspect.getattr_static(MultiConnector, "sub_connectors"), property)
    assert "self.connector_worker" in inspect.getsource(connector)
    assert "self.connector_scheduler" in inspect.getsource(connector)
    assert "self.connector = " in inspect.getsource(Scheduler.__init__)
    init = inspect.getsource(worker.MooncakeStoreWorker)
    for field in ("self.store_replicate_config", "self.kv_send_thread", "self.store "):
        assert field in init, field
    assert "self.replicate_config = replicate_config" in inspect.getsource(worker.KVCacheStoreSendingThread)
    lookup = inspect.getsource(scheduler.MooncakeStoreScheduler.__init__)
    assert "self.client = " in lookup and "self.enable_lookup = " in lookup


def test_the_scheduler_subclass_finds_what_it_overrides_and_reads() -> None:
    """``adapter.scheduler_class`` overrides and calls ``SCHEDULER_METHODS`` of vLLM's
    ``Scheduler`` and reads its ``SCHEDULER_FIELDS``; the sequencer reads a
    ``Request``'s counts and ``prefill_stats``. ``_preempt_request`` puts the request
    back at the head of ``waiting`` (the subclass takes it out of there); a missing
    method stops start-up with a message naming it."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from hybridpd.engine.vllm import adapter
    from hybridpd.engine.vllm.sequencer import Ledger
    from hybridpd.errors import StartupError

    for name in adapter.SCHEDULER_METHODS:
        assert callable(getattr(Scheduler, name)), name
    init = inspect.getsource(Scheduler.__init__)
    for name in adapter.SCHEDULER_FIELDS:
        assert "self.%s = " % name in init or "self.%s: " % name in init, name
    assert "self.waiting.prepend_request(request)" in inspect.getsource(Scheduler._preempt_request)
    assert list(inspect.signature(Scheduler._preempt_request).parameters)[:3] == ["self", "request", "timestamp"]
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1, extra_args={"hybridpd": {}}), None)
    for name in ("num_computed_tokens", "num_in_flight_tokens", "num_prompt_tokens", "prefill_stats"):
        assert hasattr(req, name), name
    assert req.sampling_params.extra_args == {"hybridpd": {}} and callable(req.is_finished)
    assert issubclass(adapter.scheduler_class(Ledger()), AsyncScheduler)  # the engine schedules async
    with pytest.raises(StartupError, match=r"Scheduler\._gone"):
        adapter.require(Scheduler, "_gone", "Scheduler")
