"""What `hybridpd` prints never holds a secret: URL passwords are masked, keys
redacted, and the banner says who may call the API."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hybridpd.config import is_loopback, load_config
from hybridpd.errors import ConfigError
from hybridpd.index.connection import redacted_url
from launch.cli import auth_line, cli


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        (
            "rediss://hpd:s3cret@r.example:6380/0?ssl_ca_certs=/ca.crt",
            "rediss://hpd:***@r.example:6380/0?ssl_ca_certs=/ca.crt",
        ),
        ("rediss://hpd:p:w@r:6380", "rediss://hpd:***@r:6380"),
        ("rediss://hpd@r:6380/0", "rediss://hpd@r:6380/0"),  # a user alone is no secret
        ("redis://127.0.0.1:6400/0", "redis://127.0.0.1:6400/0"),
        ("unix:///run/redis.sock?db=0", "unix:///run/redis.sock?db=0"),
        ("", ""),
    ],
)
def test_redacted_url(url: str, shown: str) -> None:
    assert redacted_url(url) == shown


def test_config_show_prints_no_secret() -> None:
    flags = [
        "--redis-url",
        "rediss://hpd:s3cret-pw@r:6380/0",
        "--redis-read-replicas",
        "--redis-replica-url",
        "rediss://hpd:s3cret-pw@q:6380/0",
        "--api-keys",
        "tenant-key-1",
        "--operator-api-keys",
        "operator-key-1,operator-key-2",
    ]
    for fmt in ("yaml", "json"):
        res = CliRunner().invoke(cli, ["config", "show", "--format", fmt, *flags])
        assert res.exit_code == 0, res.output
        assert "s3cret" not in res.output and "key-1" not in res.output and "key-2" not in res.output
        assert res.output.count("rediss://hpd:***@") == 2 and res.output.count("<redacted>") == 3
    data = json.loads(CliRunner().invoke(cli, ["config", "show", "--format", "json", *flags]).output)
    assert data["operator_api_keys"] == ["<redacted>"] * 2 and data["redis_url"] == "rediss://hpd:***@r:6380/0"


def test_the_banner_says_who_may_call() -> None:
    assert "open to every user of this machine" in auth_line(load_config(env={}))
    assert "OPEN to anyone" in auth_line(load_config(env={}, overrides={"host": "0.0.0.0", "allow_anonymous": True}))
    keyed = auth_line(load_config(env={}, overrides={"host": "0.0.0.0", "api_keys": "k-secret-1,k-secret-2"}))
    assert keyed.startswith("Bearer API keys required") and "k-secret" not in keyed
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")


def test_an_open_api_off_loopback_needs_allow_anonymous() -> None:
    with pytest.raises(ConfigError, match=r"0\.0\.0\.0 is not loopback: set api_keys or api_keys_file"):
        load_config(env={}, overrides={"host": "0.0.0.0"})
    assert load_config(env={}, overrides={"host": "::1"}).host == "::1"  # loopback may stay open
