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


def main() -> None:
    cli(prog_name="hybridpd")


if __name__ == "__main__":
    main()
