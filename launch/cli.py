"""The ``hybridpd`` command line.

Config flags are generated from :class:`hybridpd.config.HybridPDConfig`, so
every field is settable as ``--<field-name>`` on commands that take a config,
and ``--help`` always lists exactly the fields that exist.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import click
import yaml

from hybridpd import __version__
from hybridpd.config import HybridPDConfig, allowed, is_loopback, load_config
from hybridpd.errors import ConfigError


def config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--config`` plus one flag per config field to a click command."""
    for name, info in reversed(list(HybridPDConfig.model_fields.items())):
        flag = "--" + name.replace("_", "-")
        help_text = "%s [%s]" % (info.description or name, allowed(name))
        if info.annotation is bool:
            opt = click.option(flag + "/--no-" + name.replace("_", "-"), name, default=None, help=help_text)
        else:
            opt = click.option(flag, name, default=None, metavar="VALUE", help=help_text)
        func = opt(func)
    return click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="YAML config file (flat field: value mapping). "
        "Env vars HYBRIDPD_<FIELD> override it; flags override both.",
    )(func)


def build_config(config_path: str | None, flags: dict[str, Any]) -> HybridPDConfig:
    """Load the effective config or exit with status 2 and the ConfigError text."""
    try:
        return load_config(config_path, overrides=flags)
    except ConfigError as exc:
        click.echo("error: %s" % exc, err=True)
        sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """hybridpd: disaggregated prefill/decode serving for hybrid LLMs."""


@cli.command()
def version() -> None:
    """Print the hybridpd version."""
    click.echo(__version__)


@cli.group()
def config() -> None:
    """Inspect the configuration."""


@config.command("show")
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True)
@config_options
def config_show(fmt: str, config_path: str | None, **flags: Any) -> None:
    """Print the effective config (defaults < --config file < env < flags)."""
    data = redacted(build_config(config_path, flags))
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(yaml.safe_dump(data, sort_keys=False), nl=False)


def redacted(cfg: HybridPDConfig) -> dict[str, Any]:
    """The config as a mapping with no secret in it: keys replaced, URL passwords masked."""
    from hybridpd.index.connection import redacted_url

    data = cfg.model_dump(mode="json")
    for name in ("api_keys", "operator_api_keys"):
        data[name] = ["<redacted>"] * len(data[name])
    for name in ("redis_url", "redis_replica_url"):
        if data[name]:
            data[name] = redacted_url(data[name])
    return data


def auth_line(cfg: HybridPDConfig) -> str:
    """The banner's word on who may call the API (never a key)."""
    if cfg.api_keys or cfg.api_keys_file:
        return "Bearer API keys required (%s)" % (
            "%d in the config" % len(cfg.api_keys) if not cfg.api_keys_file else "from %s" % cfg.api_keys_file
        )
    if is_loopback(cfg.host):
        return "none: the API is open to every user of this machine (loopback only)"
    return "none: the API is OPEN to anyone who reaches %s (allow_anonymous; set --api-keys-file)" % cfg.host


def check_router_ports(cfg: HybridPDConfig) -> None:
    """Fail before anything starts when the router cannot listen on its HTTP or gRPC
    port (another process holds it): UnavailableError naming the port and its flag.
    A port lost after this check still fails ``up`` when the router binds it."""
    from hybridpd.errors import UnavailableError
    from hybridpd.procs import bind_error

    for name, port in (("http_port", cfg.http_port), ("grpc_port", cfg.grpc_port)):
        exc = bind_error(cfg.host, port)
        if exc is not None:
            flag = "--" + name.replace("_", "-")
            raise UnavailableError(
                "cannot listen on %s:%d (%s): %s; stop what holds it or choose another %s"
                % (cfg.host, port, flag, exc.strerror or exc, flag)
            )


def key_line(cfg: HybridPDConfig) -> str:
    """The banner's word on the integrity key: its file (never the key)."""
    if cfg.integrity_key_file is None:
        return "none: a public key, checks stop accidents only (set --integrity-key-file)"
    return cfg.integrity_key_file


@cli.command()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Logs and data of started services (default: a new temp dir).",
)
@click.option("--exit-after-start", is_flag=True, help="Start everything, print the URLs, stop again (a smoke check).")
@config_options
def up(workdir: str | None, exit_after_start: bool, config_path: str | None, **flags: Any) -> None:
    """Start the whole stack locally on its embedded defaults and print its URLs.

    Starts Redis (prefix index), mooncake_master (checkpoint store), a local
    Ray head with its dashboard, the prefill and decode actors (native engine,
    tiny model by default) and the router (OpenAI HTTP + gRPC), or connects to
    the services named by --redis-url / --mooncake-master / --ray-address.
    Ctrl-C (or SIGTERM) drains: /ready turns false, new requests get 503, and
    the requests in flight finish (at most --drain-grace-s); then everything it
    started stops. A second Ctrl-C stops at once. An --http-port or --grpc-port
    that another process holds ends it at once, before anything starts.
    """
    import asyncio
    import signal
    import tempfile
    from pathlib import Path

    from hybridpd.errors import HybridPDError
    from hybridpd.index.connection import redacted_url
    from hybridpd.logging import setup_logging
    from launch.stack import LocalStack
    from services.router.server import RouterServer

    setup_logging()
    cfg = build_config(config_path, flags)
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="hybridpd-"))
    stack = LocalStack(cfg, wd)
    try:
        check_router_ports(cfg)
        urls = stack.start()
        click.echo("starting %d prefill and %d decode actors..." % (cfg.num_prefill, cfg.num_decode))
        stack.start_serving()
        router = RouterServer(
            stack.orchestrator(), cfg.model, cfg.host, cfg.http_port, cfg.grpc_port, stack.actor_stats
        )
    except HybridPDError as exc:
        stack.stop()
        click.echo("error: %s" % exc, err=True)
        sys.exit(2 if isinstance(exc, ConfigError) else 1)  # an actor that failed to start: 1
    except BaseException:
        stack.stop()
        raise
    actors = [*stack.prefill, *stack.decode]
    click.echo("hybridpd is up (logs in %s)" % wd)
    scheme = "https" if cfg.tls_cert_file else "http"
    click.echo("  OpenAI HTTP          %s://%s:%d/v1" % (scheme, cfg.host, cfg.http_port))
    click.echo("  gRPC                 %s:%d%s" % (cfg.host, cfg.grpc_port, " (TLS)" if cfg.tls_cert_file else ""))
    click.echo("  Metrics              %s://%s:%d/metrics" % (scheme, cfg.host, cfg.http_port))
    click.echo("  Auth                 %s" % auth_line(cfg))
    click.echo("  Integrity key        %s" % key_line(stack.cfg))
    token = " (token auth: sign in with the token `ray get-auth-token` prints)" if urls.ray_token_auth else ""
    click.echo("  Ray dashboard        %s%s" % (urls.ray_dashboard_url, token))
    if urls.ray_address:
        click.echo("  Ray address          %s" % urls.ray_address)
    if urls.ray_metrics_url:
        click.echo("  Ray metrics (actors) %s" % urls.ray_metrics_url)
    click.echo("  Redis (prefix index) %s" % redacted_url(urls.redis_url))
    click.echo("  Mooncake master      %s" % urls.mooncake_master)
    click.echo("  Mooncake metadata    %s" % urls.mooncake_metadata_url)
    if urls.mooncake_metrics_url:
        click.echo("  Mooncake metrics     %s" % urls.mooncake_metrics_url)
    click.echo("  Actors               %s" % ", ".join(actors))

    async def serve() -> None:
        stop, force = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:  # the first drains (RouterServer.drain), a second stops at once
            if stop.is_set():
                force.set()
                return
            stop.set()
            if router.orch.admission.inflight:
                click.echo("draining (at most %.0fs; Ctrl-C again to stop now)..." % cfg.drain_grace_s)

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        if exit_after_start:
            stop.set()
        ready = asyncio.Event()
        task = asyncio.create_task(router.serve(stop, ready, force))
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait({task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)
        ready_wait.cancel()
        if ready.is_set() and not exit_after_start:  # both ports bound: only now is the stack up
            click.echo("Press Ctrl-C to stop.")
            sys.stdout.flush()
        await task

    try:
        asyncio.run(serve())
    finally:
        click.echo("stopping...")
        stack.stop()


@cli.command("drain-actors")
@click.option("--grace-s", type=float, default=120.0, show_default=True, help="Wait at most this long.")
@click.option("--address", default="auto", show_default=True, help="The Ray cluster (auto: this node's).")
@click.option("--all-nodes", is_flag=True, help="Drain the actors of every node, not only this one's.")
def drain_actors(grace_s: float, address: str, all_nodes: bool) -> None:
    """Drain this Ray node's prefill and decode actors (a pod's preStop hook).

    Each takes no new request from now on (the routers send them elsewhere) and
    this waits until none runs a request, at most --grace-s. Exit status 0 when
    drained, 1 when requests were still running at the end.
    """
    import ray

    from launch.drain import drain, node_actors

    ray.init(address=address, logging_level=logging.WARNING)
    left = drain(node_actors(all_nodes), grace_s)
    click.echo("drained" if not left else "grace over with %d requests in flight" % left)
    sys.exit(1 if left else 0)


def _add_plugin_commands() -> None:
    """Add the commands of the ``hybridpd.cli`` entry-point group (``bench``:
    ``bench/cli.py``), so ``launch`` never imports the packages built on it."""
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            cli.add_command(ep.load(), ep.name)
        except Exception as exc:  # one broken plugin must not take the rest of the CLI down
            click.echo("hybridpd: command %r not available: %s" % (ep.name, exc), err=True)


#: the entry-point group whose click commands join ``hybridpd`` (pyproject.toml)
PLUGIN_GROUP = "hybridpd.cli"
_add_plugin_commands()


def main() -> None:
    cli(prog_name="hybridpd")


if __name__ == "__main__":
    main()
