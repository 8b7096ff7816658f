"""The ``hybridpd`` command line.

Config flags are generated from :class:`hybridpd.config.HybridPDConfig`, so
every field is settable as ``--<field-name>`` on commands that take a config,
and ``--help`` always lists exactly the fields that exist.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from hybridpd import __version__
from hybridpd.config import HybridPDConfig, allowed, load_config
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
    cfg = build_config(config_path, flags)
    if fmt == "json":
        click.echo(json.dumps(cfg.model_dump(mode="json"), indent=2))
    else:
        click.echo(cfg.to_yaml(), nl=False)


@cli.command()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Logs and data of started services (default: a new temp dir).",
)
@click.option("--exit-after-start", is_flag=True, help="Start, print the URLs, stop again (a smoke check).")
@config_options
def up(workdir: str | None, exit_after_start: bool, config_path: str | None, **flags: Any) -> None:
    """Start the local stack on its embedded defaults and print its URLs.

    Starts Redis (prefix index), mooncake_master (checkpoint store) and a local
    Ray head with its dashboard, or connects to the ones named by
    --redis-url / --mooncake-master / --ray-address. Ctrl-C stops everything
    it started.
    """
    import signal
    import tempfile
    import threading
    from pathlib import Path

    from hybridpd.errors import HybridPDError
    from hybridpd.logging import setup_logging
    from hybridpd.stack import LocalStack

    setup_logging()
    cfg = build_config(config_path, flags)
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="hybridpd-"))
    stack = LocalStack(cfg, wd)
    try:
        urls = stack.start()
    except HybridPDError as exc:
        click.echo("error: %s" % exc, err=True)
        sys.exit(1)
    click.echo("hybridpd is up (logs in %s)" % wd)
    click.echo("  Ray dashboard        %s" % urls.ray_dashboard_url)
    click.echo("  Redis (prefix index) %s" % urls.redis_url)
    click.echo("  Mooncake master      %s" % urls.mooncake_master)
    click.echo("  Mooncake metadata    %s" % urls.mooncake_metadata_url)
    if urls.mooncake_metrics_url:
        click.echo("  Mooncake metrics     %s" % urls.mooncake_metrics_url)
    click.echo(
        "  Router (HTTP %s:%d, gRPC :%d) is not part of this build yet." % (cfg.host, cfg.http_port, cfg.grpc_port)
    )
    sys.stdout.flush()
    if exit_after_start:
        stack.stop()
        return
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    click.echo("Press Ctrl-C to stop.")
    sys.stdout.flush()
    done.wait()
    click.echo("stopping...")
    stack.stop()


def main() -> None:
    cli(prog_name="hybridpd")


if __name__ == "__main__":
    main()
