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
    extra: dict[str, str] = field(default_factory=dict)


class LocalStack:
    def __init__(self, cfg: HybridPDConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.urls = StackUrls()
        self.redis: RedisServer | None = None
        self.master: MooncakeMaster | None = None
        self.ray_started = False

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
                logging_level=logging.WARNING,
            )
            self.ray_started = True
        self.urls.ray_address = getattr(ctx, "address_info", {}).get("gcs_address", "")
        dash = ctx.dashboard_url or ""
        self.urls.ray_dashboard_url = dash if dash.startswith("http") else ("http://" + dash if dash else "")

    def stop(self) -> None:
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
