"""The embedded local stack that ``hybridpd up`` runs.

Starts (or connects to, when the config names external ones):

* Redis for the global prefix index (``redis_url``), on a free port, never 6379;
* ``mooncake_master`` for the checkpoint store (``mooncake_master``);
* a local Ray head with its dashboard on ``127.0.0.1:<dashboard_port>``
  (``ray_address``). Token auth is disabled for this local, loopback-only
  cluster (``RAY_AUTH_MODE=disabled``) so the dashboard opens in a browser.

``stop()`` ends everything it started, in reverse order; external services are
left alone. Logs go under the work directory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridpd.config import HybridPDConfig
from hybridpd.errors import UnavailableError
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from hybridpd.procs import port_open
from hybridpd.store.master import MooncakeMaster

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StackUrls:
    redis_url: str = ""
    mooncake_master: str = ""
    mooncake_metadata_url: str = ""
    mooncake_metrics_url: str = ""
    ray_address: str = ""
    ray_dashboard_url: str = ""
    ray_metrics_url: str = ""
    extra: dict[str, str] = field(default_factory=dict)


class LocalStack:
    def __init__(self, cfg: HybridPDConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.urls = StackUrls()
        self.redis: RedisServer | None = None
        self.master: MooncakeMaster | None = None
        self.ray_started = False
        self.prefill: dict[str, Any] = {}
        self.decode: list[Any] = []
        self.model_id = ""

    def start(self) -> StackUrls:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_redis()
            self._start_mooncake()
            self._start_ray()
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _start_redis(self) -> None:
        if self.cfg.redis_url:
            PrefixIndex(self.cfg.redis_url, "probe").ping()  # fail fast with a clear error
            self.urls.redis_url = self.cfg.redis_url
            return
        self.redis = RedisServer(self.workdir)
        self.redis.start()
        self.urls.redis_url = self.redis.url

    def _start_mooncake(self) -> None:
        if self.cfg.mooncake_master:
            host, _, port = self.cfg.mooncake_master.rpartition(":")
            if not port_open(host, int(port), timeout=2.0):
                raise UnavailableError("mooncake master %s is not reachable" % self.cfg.mooncake_master)
            self.urls.mooncake_master = self.cfg.mooncake_master
            self.urls.mooncake_metadata_url = self.cfg.metadata_url() or ""
            return
        self.master = MooncakeMaster(self.workdir)
        self.master.start()
        self.urls.mooncake_master = self.master.address
        self.urls.mooncake_metadata_url = self.master.metadata_url
        self.urls.mooncake_metrics_url = "http://%s:%d/metrics" % (self.master.host, self.master.metrics_port)

    def _start_ray(self) -> None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray

        if self.cfg.ray_address:
            ctx = ray.init(address=self.cfg.ray_address, logging_level=logging.WARNING)
        else:
            ctx = ray.init(
                include_dashboard=True,
                dashboard_host="127.0.0.1",
                dashboard_port=self.cfg.dashboard_port,
                _metrics_export_port=self.cfg.ray_metrics_port,
                logging_level=logging.WARNING,
            )
            self.ray_started = True
        self.urls.ray_address = getattr(ctx, "address_info", {}).get("gcs_address", "")
        dash = ctx.dashboard_url or ""
        self.urls.ray_dashboard_url = dash if dash.startswith("http") else ("http://" + dash if dash else "")
        if self.ray_started:
            self.urls.ray_metrics_url = "http://127.0.0.1:%d/metrics" % self.cfg.ray_metrics_port

    # -- serving: actors and the router ------------------------------------------------
    def start_serving(self, timeout_s: float = 600.0) -> None:
        """Start the prefill and decode actors (the model is built first, once)."""
        import ray

        from hybridpd.engine.factory import resolve_model
        from services.actors import NAMESPACE, DecodeActor, PrefillActor

        resolve_model(self.cfg)  # build the tiny model here, not racing in every actor
        # NOTE: glog level 2 keeps Mooncake's per-connection INFO/WARNING lines out of the actor logs
        # NOTE: MALLOC_ARENA_MAX=2: Ray runs actor calls on a thread pool and glibc gives each
        # thread its own malloc arena; with 2 the soak's RSS growth fell by half or more
        env = {
            "GLOG_minloglevel": "2",
            "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
            "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2"),
        }
        # NOTE: max_restarts: Ray brings a crashed actor back; the router retries elsewhere meanwhile
        opts = {
            "namespace": NAMESPACE,
            "num_cpus": 0,
            "max_concurrency": 256,
            "max_restarts": 3,
            "runtime_env": {"env_vars": env},
        }
        prefill_opts, decode_opts = dict(opts), dict(opts)
        if self.cfg.actor_placement == "worker_groups":
            # NOTE: detached + get_if_exists: every router replica attaches to the same actors
            shared = {"lifetime": "detached", "get_if_exists": True, "num_gpus": self.cfg.actor_num_gpus}
            prefill_opts.update(shared, resources={"hybridpd_prefill": 1})
            decode_opts.update(shared, resources={"hybridpd_decode": 1})
        elif self.cfg.actor_num_gpus:
            prefill_opts["num_gpus"] = decode_opts["num_gpus"] = self.cfg.actor_num_gpus
        self.prefill = {
            "prefill-%d" % i: PrefillActor.options(name="prefill-%d" % i, **prefill_opts).remote(
                self.cfg,
                "prefill-%d" % i,
                self.urls.redis_url,
                self.urls.mooncake_master,
                self.urls.mooncake_metadata_url,
            )
            for i in range(self.cfg.num_prefill)
        }
        self.decode = [
            DecodeActor.options(name="decode-%d" % i, **decode_opts).remote(self.cfg, "decode-%d" % i)
            for i in range(self.cfg.num_decode)
        ]
        handles = [*self.prefill.values(), *self.decode]
        ray.get([h.ready.remote() for h in handles], timeout=timeout_s)
        self.model_id = ray.get(next(iter(self.prefill.values())).model_id.remote())

    def orchestrator(self):
        from hybridpd.engine.factory import resolve_model
        from hybridpd.tokenizer import TextTokenizer
        from services.router.metrics import RouterMetrics
        from services.router.orchestrator import Orchestrator

        index = PrefixIndex(self.urls.redis_url, self.model_id) if self.urls.redis_url else None
        tok = TextTokenizer(Path(resolve_model(self.cfg)))
        return Orchestrator(self.cfg, tok, self.model_id, index, self.prefill, self.decode, RouterMetrics())

    async def actor_stats(self) -> dict:
        import asyncio

        names = [*self.prefill, *("decode-%d" % i for i in range(len(self.decode)))]
        refs = [h.stats.remote() for h in [*self.prefill.values(), *self.decode]]
        got = await asyncio.gather(*refs, return_exceptions=True)
        # an actor that is down or restarting is reported, not allowed to hide the others
        return {
            n: ({"error": "%s: %s" % (type(g).__name__, str(g)[:200])} if isinstance(g, BaseException) else g)
            for n, g in zip(names, got, strict=True)
        }

    def stop(self) -> None:
        shared = self.cfg.actor_placement == "worker_groups"  # other router replicas still use them
        for h in [] if shared else [*self.prefill.values(), *self.decode]:
            try:
                import ray

                ray.get(h.close.remote(), timeout=10)
            except Exception:  # an actor that is already gone needs no closing
                logger.debug("actor close failed", exc_info=True)
        self.prefill, self.decode = {}, []
        if self.ray_started:
            import ray

            ray.shutdown()
            self.ray_started = False
        if self.master is not None:
            self.master.stop()
            self.master = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
