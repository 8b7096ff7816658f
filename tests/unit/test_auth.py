"""API keys, operator keys, keys files read again on change, and tenant salts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from hybridpd.auth import RELOAD_CHECK_S, ApiKeys, Caller, sees_cache_details, tenant_id
from hybridpd.config import load_config
from hybridpd.errors import AuthError, ForbiddenError, grpc_code, http_status
from launch.cli import cli


def test_keys_off_by_default() -> None:
    keys = ApiKeys.from_config(load_config(env={}))
    assert not keys.enabled and keys.tenant(None) is None
    assert keys.caller("Bearer sk-anything") == Caller(None, True)  # an open loopback stack: its users operate it
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


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _rewrite(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a change even within one tick


def test_a_keys_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path, clock = tmp_path / "keys", Clock()
    path.write_text("# rotated weekly\n\nkey-a\n  key-b  \n")
    keys = ApiKeys(keys=["static"], keys_file=str(path), clock=clock)
    assert keys.tenant("Bearer key-a") == tenant_id("key-a") and keys.tenant("Bearer key-b") == tenant_id("key-b")
    _rewrite(path, "key-c\n")
    assert keys.tenant("Bearer key-a") == tenant_id("key-a")  # checked at most every RELOAD_CHECK_S
    clock.now += RELOAD_CHECK_S
    assert keys.tenant("Bearer key-c") == tenant_id("key-c") and keys.tenant("Bearer static")
    with pytest.raises(AuthError, match="invalid API key"):
        keys.tenant("Bearer key-a")
    path.unlink()  # a Secret being swapped: the last keys stay
    clock.now += RELOAD_CHECK_S
    assert keys.tenant("Bearer key-c") == tenant_id("key-c")


def test_an_empty_keys_file_lets_no_one_in(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# none yet\n")
    keys = ApiKeys(keys_file=str(path))
    assert keys.enabled
    for header in (None, "Bearer ", "Bearer # none yet", "Bearer anything"):
        with pytest.raises(AuthError):
            keys.caller(header)


def test_operator_keys(tmp_path: Path) -> None:
    ops = tmp_path / "ops"
    ops.write_text("op-1\n")
    keys = ApiKeys(keys=["client"], operator_keys=["op-0"], operator_keys_file=str(ops))
    assert keys.caller("Bearer client") == Caller(tenant_id("client"), False)
    assert keys.caller("Bearer op-0") == Caller(tenant_id("op-0"), True) and keys.caller("Bearer op-1").operator
    with pytest.raises(ForbiddenError, match="/v1/hybridpd/stats needs an operator key"):
        keys.caller("Bearer client").need_operator("/v1/hybridpd/stats")
    assert int(http_status(ForbiddenError("x"))) == 403 and grpc_code(ForbiddenError("x")).name == "PERMISSION_DENIED"
    # an open API with operator keys: anonymous callers are no operators
    open_api = ApiKeys(operator_keys=["op-0"])
    assert not open_api.enabled and open_api.caller(None) == Caller(None, False)
    assert open_api.caller("Bearer op-0").operator
    # an open API off loopback (allow_anonymous): no one is an operator without a key
    cfg = load_config(env={}, overrides={"host": "0.0.0.0", "allow_anonymous": True})
    assert ApiKeys.from_config(cfg).caller(None) == Caller(None, False)


def test_who_sees_cache_details() -> None:
    op, client = Caller("t", True), Caller("u", False)
    assert sees_cache_details("operator", op) and not sees_cache_details("operator", client)
    assert sees_cache_details("everyone", client) and not sees_cache_details("off", op)
