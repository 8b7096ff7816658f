"""The embedded local stack that ``hybridpd up`` runs.

Starts (or connects to, when the config names external ones):

* Redis for the global prefix index (``redis_url``), on a free port, never 6379;
* ``mooncake_master`` for the checkpoint store (``mooncake_master``);
* a local Ray head with its dashboard on ``127.0.0.1:<dashboard_port>``
  (``ray_address``), with Ray's own default: token auth (the token in
  ``~/.ray/auth_token``; ``ray get-auth-token`` prints it), which every actor and
  the dashboard then require. Nothing here turns it off (``RAY_AUTH_MODE`` in
  the environment is Ray's to read).

``stop()`` ends everything it started, in reverse order; external services are
left alone. Logs go under the work directory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hybridpd.config import HybridPDConfig
from hybridpd.errors import ConfigError, StartupError, UnavailableError
from hybridpd.index.connection import redacted_url
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from hybridpd.integrity import load_key, stack_key
from hybridpd.procs import listen_ports, port_open
from hybridpd.store.master import MooncakeMaster
from launch.attach import check_identity, wait_ready
from services.worker.api import DecodeClient, PrefillClient, decode_name, prefill_name
from services.worker.token_channel import TokenSink, token_sink_host

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StackUrls:
    redis_url: str = ""
    mooncake_master: str = ""
    mooncake_metadata_url: str = ""
    mooncake_metrics_url: str = ""
    ray_address: str = ""
    ray_dashboard_url: str = ""
    #: whether Ray requires its token (the dashboard too)
    ray_token_auth: bool = False
    ray_metrics_url: str = ""
    extra: dict[str, str] = field(default_factory=dict)


def ray_token_auth() -> bool:
    """Whether the Ray this process joined requires its auth token (Ray's own check)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token auth
        return False
    return bool(is_token_auth_enabled())


class LocalStack:
    def __init__(self, cfg: HybridPDConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.urls = StackUrls()
        self.redis: RedisServer | None = None
        self.master: MooncakeMaster | None = None
        self.ray_started = False
        self.token_sink: TokenSink | None = None
        #: the workers' Ray actor handles, by instance name
        self.prefill: dict[str, ActorHandle[Any]] = {}
        self.decode: dict[str, ActorHandle[Any]] = {}
        self.model_id = ""

    def start(self) -> StackUrls:
        self.check()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cfg = stack_key(self.cfg, self.workdir)  # integrity.py: a local stack's own key
        try:
            self._start_redis()
            self._start_mooncake()
            self._start_ray()
        except BaseException:
            self.stop()
            raise
        return self.urls

    def check(self) -> None:
        """Config errors that need the model, raised before anything starts (ConfigError)."""
        if self.cfg.engine == "vllm":
            from hybridpd.engine.factory import resolve_model
            from hybridpd.engine.vllm.args import check_dtype

            check_dtype(self.cfg, resolve_model(self.cfg))  # else: a failure on every request

    def _start_redis(self) -> None:
        if self.cfg.redis_url:
            probe = PrefixIndex(self.cfg.redis_url, "probe")
            try:
                version, is_cluster = probe.server_info()  # fail fast with a clear error
            except UnavailableError as exc:
                import redis

                if isinstance(exc.__cause__, redis.AuthenticationError) or "credentials" in str(exc):
                    raise  # a wrong password is a config error, not an outage
                # NOTE: an outage (a Redis restarting in a rollout, say) must not crash-loop the router:
                # the index clients connect lazily, every lookup and publish is a miss until it is back
                logger.warning(
                    "the index's Redis at %s is not reachable (%s): serving without the prefix index"
                    " (prompts are recomputed) until it is",
                    redacted_url(self.cfg.redis_url),
                    exc,
                )
                self.urls.redis_url = self.cfg.redis_url
                return
            if is_cluster is not None and is_cluster != self.cfg.redis_cluster:
                raise ConfigError(
                    "redis_cluster",
                    "the Redis at redis_url %s in cluster mode: %s"
                    % (
                        ("runs", "set redis_cluster (--redis-cluster)")
                        if is_cluster
                        else ("does not run", "unset redis_cluster or point at a cluster node")
                    ),
                )
            if version and tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < (6, 2):
                raise UnavailableError("the index needs Redis 6.2 or newer (SMISMEMBER); redis_url runs %s" % version)
            PrefixIndex(self.cfg.redis_url, "probe", cluster=self.cfg.redis_cluster).ping()
            self.urls.redis_url = self.cfg.redis_url
            return
        self.redis = RedisServer(self.workdir)
        self.redis.start()
        self.urls.redis_url = self.redis.url

    def _start_mooncake(self) -> None:
        if self.cfg.mooncake_master:
            host, _, port = self.cfg.mooncake_master.rpartition(":")
            if not port_open(host, int(port), timeout=2.0):
                # NOTE: an outage must not crash-loop the router: the prefill actors connect to the
                # store lazily (CheckpointStore(lazy=True)); until then every store hit is a miss
                logger.warning(
                    "the Mooncake master %s is not reachable: serving without the checkpoint store"
                    " (prompts are recomputed) until it is",
                    self.cfg.mooncake_master,
                )
            self.urls.mooncake_master = self.cfg.mooncake_master
            self.urls.mooncake_metadata_url = self.cfg.metadata_url() or ""
            return
        self.master = MooncakeMaster(self.workdir)
        self.master.start()
        self.urls.mooncake_master = self.master.address
        self.urls.mooncake_metadata_url = self.master.metadata_url
        self.urls.mooncake_metrics_url = "http://%s:%d/metrics" % (self.master.host, self.master.metrics_port)

    def _start_ray(self) -> None:
        import ray

        if self.cfg.ray_address:
            ctx = ray.init(address=self.cfg.ray_address, logging_level=logging.WARNING)
        else:
            # NOTE: address="local": always a new head; a bare ray.init() would join whatever cluster
            # `ray start` last left on this machine (/tmp/ray/ray_current_cluster), even a dead one
            ctx = ray.init(
                address="local",
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
        self.urls.ray_token_auth = ray_token_auth()

    # -- serving: actors and the router ------------------------------------------------
    def start_serving(self, timeout_s: float = 600.0) -> None:
        """Start the prefill and decode actors (the model is built first, once)."""

        from hybridpd.engine.factory import resolve_model
        from hybridpd.model_identity import engine_identity
        from launch.actors import DecodeActor, PrefillActor, namespace

        model_dir = resolve_model(self.cfg)  # build the tiny model here, not racing in every actor
        expected = engine_identity(self.cfg, model_dir) if isinstance(model_dir, Path) else None
        # NOTE: glog level 2 keeps Mooncake's per-connection INFO/WARNING lines out of the actor logs
        # NOTE: MALLOC_ARENA_MAX=2: Ray runs actor calls on a thread pool and glibc gives each
        # thread its own malloc arena; with 2 the soak's RSS growth fell by half or more
        env = {
            "GLOG_minloglevel": "2",
            "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2"),
        }
        # NOTE: max_restarts: Ray brings a crashed actor back; the router retries elsewhere meanwhile
        opts = {
            "namespace": namespace(expected),
            "num_cpus": 0,
            "max_concurrency": 256,
            "max_restarts": 3,
            "runtime_env": {"env_vars": env},
        }
        if self.cfg.engine == "vllm" and self.cfg.actor_placement != "worker_groups":
            # NOTE: every port an actor binds is its own: vLLM's NIXL side channel (fixed by
            # default) gets a distinct port per actor, chosen here where all of them are known
            names = [*self._prefill_names(), *self._decode_names()]
            side = dict(zip(names, listen_ports(len(names)), strict=True))
        else:
            side = {}

        def with_env(o: dict[str, Any], name: str) -> dict[str, Any]:
            if name not in side:
                return o
            vars_ = {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side[name]), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
            return {**o, "runtime_env": {"env_vars": vars_}}

        prefill_opts, decode_opts = dict(opts), dict(opts)
        if self.cfg.actor_placement == "worker_groups":
            # NOTE: detached + get_if_exists: every router replica attaches to the same actors
            shared = {"lifetime": "detached", "get_if_exists": True}
            prefill_opts.update(shared, resources={self.cfg.prefill_resource: 1})
            decode_opts.update(shared, resources={self.cfg.decode_resource: 1})
        for role, o in (("prefill", prefill_opts), ("decode", decode_opts)):
            if self.cfg.num_gpus(role):
                o["num_gpus"] = self.cfg.num_gpus(role)
        urls = self.urls
        self.prefill = {
            n: cast(
                "ActorHandle[Any]",
                PrefillActor.options(name=n, **with_env(prefill_opts, n)).remote(
                    self.cfg, n, urls.redis_url, urls.mooncake_master, urls.mooncake_metadata_url
                ),
            )
            for n in self._prefill_names()
        }
        self.decode = {
            n: cast(
                "ActorHandle[Any]",
                DecodeActor.options(name=n, **with_env(decode_opts, n)).remote(self.cfg, n, urls.redis_url),
            )
            for n in self._decode_names()
        }
        try:
            wait_ready({**self.prefill, **self.decode}, timeout_s, kill=self.cfg.actor_placement != "worker_groups")
        except StartupError:
            self.prefill, self.decode = {}, {}
            raise
        self.model_id = check_identity({**self.prefill, **self.decode}, expected)

    def _prefill_names(self) -> list[str]:
        return [prefill_name(i) for i in range(self.cfg.num_prefill)]

    def _decode_names(self) -> list[str]:
        return [decode_name(j) for j in range(self.cfg.num_decode)]

    def orchestrator(self):
        from hybridpd.engine.factory import resolve_model
        from hybridpd.tokenizer import TextTokenizer
        from services.router.metrics import RouterMetrics
        from services.router.orchestrator import Orchestrator

        index = (
            PrefixIndex(
                self.urls.redis_url,
                self.model_id,
                cluster=self.cfg.redis_cluster,
                read_replicas=self.cfg.redis_read_replicas,
                replica_url=self.cfg.redis_replica_url,
            )
            if self.urls.redis_url
            else None
        )
        tok = TextTokenizer(Path(resolve_model(self.cfg)))
        prefill = {n: PrefillClient(n, h) for n, h in self.prefill.items()}
        metrics = RouterMetrics()
        cfg = self.cfg
        sink = self.token_sink = (
            TokenSink(token_sink_host(cfg), load_key(cfg), cfg.max_token_frame_bytes, metrics.token_frame_refused)
            if cfg.token_channel == "zmq"
            else None
        )
        decode = {n: DecodeClient(n, h, sink) for n, h in self.decode.items()}
        return Orchestrator(self.cfg, tok, self.model_id, index, prefill, decode, metrics)

    async def actor_stats(self) -> dict:
        import asyncio

        handles = {**self.prefill, **self.decode}
        names = list(handles)
        refs = [h.stats.remote() for h in handles.values()]
        got = await asyncio.gather(*refs, return_exceptions=True)
        # an actor that is down or restarting is reported, not allowed to hide the others
        return {
            n: ({"error": "%s: %s" % (type(g).__name__, str(g)[:200])} if isinstance(g, BaseException) else g)
            for n, g in zip(names, got, strict=True)
        }

    def stop(self) -> None:
        shared = self.cfg.actor_placement == "worker_groups"  # other router replicas still use them
        for h in [] if shared else [*self.prefill.values(), *self.decode.values()]:
            try:
                import ray

                ray.get(h.close.remote(), timeout=10)
            except Exception:  # an actor that is already gone needs no closing
                logger.debug("actor close failed", exc_info=True)
        self.prefill, self.decode = {}, {}
        if self.token_sink is not None:
            self.token_sink.close()
            self.token_sink = None
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
