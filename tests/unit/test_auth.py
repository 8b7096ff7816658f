"""API keys and tenant salts."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from hybridpd.auth import ApiKeys, tenant_id
from hybridpd.config import load_config
from hybridpd.errors import AuthError, grpc_code, http_status
from launch.cli import cli


def test_keys_off_by_default() -> None:
    keys = ApiKeys(load_config(env={}).api_keys)
    assert not keys.enabled and keys.tenant(None) is None
    assert ApiKeys.salt(None, "s") == "s"


def test_bearer_keys() -> None:
    keys = ApiKeys(["alpha", "beta"])
    assert keys.tenant("Bearer alpha") == tenant_id("alpha") != tenant_id("beta") == keys.tenant("bearer beta")
    for bad in (None, "", "Bearer", "Basic alpha", "Bearer gamma", "Bearer alph"):
        with pytest.raises(AuthError):
            keys.tenant(bad)
    assert int(http_status(AuthError("x"))) == 401 and grpc_code(AuthError("x")).name == "UNAUTHENTICATED"


def test_tenant_salts_never_collide_with_client_salts() -> None:
    a, b = tenant_id("alpha"), tenant_id("beta")
    assert ApiKeys.salt(a, "x") != ApiKeys.salt(b, "x")
    assert ApiKeys.salt(a, None) != ApiKeys.salt(b, None)
    assert ApiKeys.salt(a, "x") != "x"  # a tenant cannot mimic an unauthenticated salt


def test_config_parses_and_redacts_keys() -> None:
    cfg = load_config(env={"HYBRIDPD_API_KEYS": "k1, k2"})
    assert cfg.api_keys == ["k1", "k2"]
    res = CliRunner().invoke(cli, ["config", "show", "--api-keys", "secret-1,secret-2"])
    assert res.exit_code == 0 and "secret" not in res.output and res.output.count("<redacted>") == 2
