"""What prefill and decode workers share: identity and Ray metrics wiring."""

from __future__ import annotations

import os
import threading
from dataclasses import asdict
from typing import Any

from hybridpd.config import HybridPDConfig
from services.actor_metrics import ActorMetrics
from services.engine_loop import EngineLoop


class WorkerBase:
    cfg: HybridPDConfig
    name: str
    engine: Any  # NativeEngine or VllmEngine (hybridpd.engine.factory)
    loop: EngineLoop
    stats_lock: threading.Lock
    counters: dict[str, Any]

    def _base_stats(self) -> dict[str, Any]:
        """Identity, pool accounting and counters: the part of ``stats()`` every worker has."""
        with self.loop.lock:
            pool = self.engine.stats()
        with self.stats_lock:
            counters = dict(self.counters)
        return {
            "name": self.name,
            "model_id": self.engine.model_id,
            "pid": os.getpid(),
            "pool": asdict(pool),
            **counters,
        }

    def _allow_fault(self, kind: str, known: str) -> None:
        """Raise unless fault injection is on and ``kind`` is this worker's fault."""
        if not self.cfg.fault_injection:
            raise PermissionError("fault injection is disabled")
        if kind != known:
            raise ValueError("unknown fault %r" % kind)

    def ready(self) -> str:
        """Returns once the actor is constructed (engine loaded)."""
        return self.name

    def model_id(self) -> str:
        return self.engine.model_id


def ray_metrics(name: str, counters: dict, gauges: dict, histograms: dict) -> ActorMetrics | None:
    """Ray metrics when running in Ray; None elsewhere (plain in-process use)."""
    import ray

    if not ray.is_initialized():
        return None
    return ActorMetrics(name, counters, gauges, histograms)
