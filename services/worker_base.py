"""What prefill and decode workers share: identity and Ray metrics wiring."""

from __future__ import annotations

from hybridpd.engine.native.engine import NativeEngine
from services.actor_metrics import ActorMetrics


class WorkerBase:
    name: str
    engine: NativeEngine

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
