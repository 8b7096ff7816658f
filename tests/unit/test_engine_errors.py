"""Engine exceptions become clean errors; actors' errors reach clients without Ray's
wrapper; ports handed to late binders are distinct and outside the ephemeral range."""

from __future__ import annotations

import socket
import threading
from http import HTTPStatus

import grpc
import pytest

from hybridpd.errors import EngineError, InvalidRequestError, describe, grpc_code, http_status, unwrap
from hybridpd.procs import LISTEN_PORTS_FROM, ephemeral_range, listen_ports
from services.worker.base import WorkerBase


class _Worker(WorkerBase):
    def __init__(self) -> None:
        self.name = "prefill-7"
        self.stats_lock = threading.Lock()


def test_an_engine_assertion_becomes_an_engine_error_naming_the_worker() -> None:
    w = _Worker()
    with pytest.raises(
        EngineError, match=r"engine failure on prefill-7: AssertionError: CPU GDN attention requires BF16"
    ):
        with w.engine_errors():
            raise AssertionError("CPU GDN attention requires BF16.")
    with pytest.raises(InvalidRequestError):  # our own errors pass unchanged
        with w.engine_errors():
            raise InvalidRequestError("bad")
    exc = EngineError("engine failure on prefill-7: AssertionError: x")
    assert http_status(exc) == HTTPStatus.SERVICE_UNAVAILABLE and grpc_code(exc) == grpc.StatusCode.UNAVAILABLE


def test_an_actor_error_is_described_without_rays_wrapper() -> None:
    from ray.exceptions import RayTaskError

    cause = EngineError("engine failure on decode-0: AssertionError: boom")
    wrapped = RayTaskError("generate", "Traceback (most recent call last): ...", cause).as_instanceof_cause()
    assert isinstance(wrapped, EngineError) and "pid=" in str(wrapped)  # Ray's text, not the error
    assert unwrap(wrapped) is cause
    assert describe(wrapped) == "engine failure on decode-0: AssertionError: boom"
    assert http_status(wrapped) == HTTPStatus.SERVICE_UNAVAILABLE


def test_listen_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    ports = listen_ports(8)
    assert len(set(ports)) == 8
    lo, _ = ephemeral_range()
    assert all(LISTEN_PORTS_FROM <= p < lo and p != 6379 for p in ports)  # above Ray's worker ports too
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_dying_while_a_worker_starts_fails_the_start() -> None:
    """vLLM's constructor waits forever for its NIXL handshake listener thread; if that
    thread dies (its port taken), the start must fail with the thread's error, not hang."""
    from hybridpd.errors import StartupError
    from services.worker.base import startup_guard

    def listener() -> None:
        raise OSError("Address already in use")

    ready = threading.Event()
    with pytest.raises(StartupError, match=r"prefill-1: thread 'listener' failed while starting: OSError: Address"):
        with startup_guard("prefill-1", grace_s=0.2):
            threading.Thread(target=listener, name="listener").start()
            ready.wait(30)  # never set: only the guard ends this wait
    with startup_guard("prefill-1", grace_s=0.2):  # a clean start is untouched
        pass
