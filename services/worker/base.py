"""What prefill and decode workers share: identity and Ray metrics wiring."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

import hybridpd
from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import Engine
from hybridpd.errors import EngineError, HybridPDError, StartupError, UnavailableError
from hybridpd.hashing import hashed_blocks
from services.worker.engine_loop import EngineLoop
from services.worker.metrics import ActorMetrics, DecodeCounters, PrefillCounters

logger = logging.getLogger(__name__)


class WorkerBase:
    cfg: HybridPDConfig
    name: str
    engine: Engine
    loop: EngineLoop
    stats_lock: threading.Lock
    counters: PrefillCounters | DecodeCounters
    #: set for good by ``drain``: new work is refused, the router sends it elsewhere
    draining: bool = False

    def _base_stats(self) -> dict[str, object]:
        """Identity, pool accounting and counters: the part of ``stats()`` every worker has."""
        with self.loop.lock:
            pool = self.engine.stats()
        with self.stats_lock:
            counters = asdict(self.counters)
        return {
            "name": self.name,
            "model_id": self.engine.model_id,
            "release": hybridpd.__version__,
            "pid": os.getpid(),
            "ray_node_id": _ray_node_id(),
            "pool": asdict(pool),
            #: blocks this worker's process hashed (``hashing.hashed_blocks``): only what came
            #: without the router's chain (an answer's new blocks, a request not routed)
            "hashed_blocks": hashed_blocks(),
            **counters,
        }

    def inject_fault(self, kind: str) -> None:
        """Test hook: the engine injects ``kind`` (only when the config enables fault injection)."""
        if not self.cfg.fault_injection:
            raise PermissionError("fault injection is disabled")
        self.engine.inject_fault(kind)

    @contextmanager
    def engine_errors(self) -> Iterator[None]:
        """Around a request: an engine's own exception (not one of ours) becomes an
        EngineError naming this worker and the error, which the router maps like any
        other (503, the request retried elsewhere where it can be). Its text is for
        logs: the router logs it with the request id and tells the client only that
        an engine failed, and that id (``errors.public_message``)."""
        try:
            yield
        except HybridPDError:
            raise
        except Exception as exc:
            logger.exception("%s: engine failure", self.name)
            raise EngineError("engine failure on %s: %s: %s" % (self.name, type(exc).__name__, exc)) from exc

    def ready(self) -> str:
        """Returns once the actor is constructed (engine loaded)."""
        return self.name

    def serving(self) -> bool:
        """Whether this worker takes new work (it answers: it is live; and it does not
        drain): the router's ping (``Dispatcher.unserved``)."""
        return not self.draining

    def drain(self) -> int:
        """Take no new work from now on (it is refused with UnavailableError, which the
        router retries elsewhere; its pings see this worker as not serving) and say how
        many requests it still runs (``running``): ``hybridpd drain-actors`` waits for 0."""
        if not self.draining:
            logger.warning("%s: draining, %d requests in flight", self.name, self.loop.in_flight())
        self.draining = True
        return self.running()

    def running(self) -> int:
        """Requests this worker runs now (prepared, submitted, not finished)."""
        return self.loop.in_flight()

    def refuse_if_draining(self) -> None:
        """UnavailableError for new work while draining (``drain``)."""
        if self.draining:
            raise UnavailableError("%s is draining: it takes no new request" % self.name)

    def model_id(self) -> str:
        return self.engine.model_id

    def identity(self) -> tuple[str, str]:
        """(the engine's model identity, the hybridpd release): what a router checks
        before it attaches (``launch/stack.py``)."""
        return self.engine.model_id, hybridpd.__version__


@contextmanager
def startup_guard(name: str, grace_s: float = 5.0) -> Iterator[None]:
    """While a worker is constructed, an exception escaping any thread fails the construction.

    An engine's constructor may wait for a thread it started: vLLM's waits, with no timeout,
    for its NIXL handshake listener, which dies if its port is taken, and the actor would
    hang forever while `hybridpd up` waits for it. So an uncaught thread exception is
    recorded and, if the constructor is still running ``grace_s`` later, raised in the main
    thread as a StartupError (a signal interrupts its wait); the creation task fails with
    it, and `hybridpd up` exits with it. Outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    failed: list[StartupError] = []
    state = threading.Lock()
    active = [True]
    prev_hook = threading.excepthook

    def interrupt() -> None:
        with state:
            if active[0]:
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR2)

    def hook(args: threading.ExceptHookArgs) -> None:
        prev_hook(args)
        if failed or args.exc_type is SystemExit:
            return
        thread = args.thread.name if args.thread is not None else "?"
        failed.append(
            StartupError(
                "%s: thread %r failed while starting: %s: %s" % (name, thread, args.exc_type.__name__, args.exc_value)
            )
        )
        timer = threading.Timer(grace_s, interrupt)
        timer.daemon = True
        timer.start()

    def on_signal(signum: int, frame: object) -> None:
        if failed:
            raise failed[0]

    prev_signal = signal.signal(signal.SIGUSR2, on_signal)
    threading.excepthook = hook
    try:
        yield
    finally:
        with state:
            active[0] = False
        threading.excepthook = prev_hook
        signal.signal(signal.SIGUSR2, prev_signal)


def ray_metrics(name: str, counters: dict, gauges: dict, histograms: dict) -> ActorMetrics | None:
    """Ray metrics when running in Ray; None elsewhere (plain in-process use)."""
    import ray

    if not ray.is_initialized():
        return None
    return ActorMetrics(name, counters, gauges, histograms)


def _ray_node_id() -> str | None:
    """The Ray node this worker runs on (hex), or None outside a Ray worker."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # an old or absent Ray: the field is informational
        return None
