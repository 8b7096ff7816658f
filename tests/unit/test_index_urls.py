"""The index client keeps what a Redis URL says: a rediss:// scheme (TLS, with its
ssl_* options) and an ACL user reach every connection it makes, the primary's and
the replicas' (cluster replicas get the primary URL's credentials and TLS)."""

from __future__ import annotations

from typing import Any

import pytest
from redis.connection import Connection, SSLConnection

from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.procs import free_port

CA = "/etc/hybridpd-redis-ca/ca.crt"


def _pool_of(index: PrefixIndex) -> Any:
    return index.r.connection_pool


@pytest.mark.parametrize(
    ("url", "ssl", "user", "password"),
    [
        ("rediss://hpd-index:s3cret@r.example:6380/2?ssl_ca_certs=" + CA, True, "hpd-index", "s3cret"),
        ("rediss://:s3cret@r.example:6380/2", True, None, "s3cret"),
        ("rediss://hpd-index:p%40ss%3Aw@r.example:6380/2", True, "hpd-index", "p@ss:w"),  # percent-encoded
        ("redis://hpd-index:s3cret@r.example:6379/2", False, "hpd-index", "s3cret"),
    ],
)
def test_the_primary_keeps_scheme_user_and_tls_options(url: str, ssl: bool, user: str | None, password: str) -> None:
    pool = _pool_of(PrefixIndex(url, "m"))  # a plain client connects lazily: nothing is dialled here
    assert pool.connection_class is (SSLConnection if ssl else Connection)
    kw = pool.connection_kwargs
    assert (kw.get("username"), kw["password"], kw["host"], kw["db"]) == (user, password, "r.example", 2)
    if "ssl_ca_certs" in url:
        assert kw["ssl_ca_certs"] == CA
        conn = pool.make_connection()
        assert conn.ca_certs == CA and conn.cert_reqs.name == "CERT_REQUIRED" and conn.check_hostname


def test_a_replica_url_keeps_its_own_scheme_and_user() -> None:
    port = free_port()  # nothing listens: the first check fails at once, the pool is what counts
    url = "rediss://hpd-index:s3cret@127.0.0.1:%d/0?ssl_ca_certs=%s" % (port, CA)
    index = PrefixIndex(url, "m", read_replicas=True, replica_url=url.replace("s3cret", "r3plica"))
    rep = index._replica_at(None)
    assert not rep.ok and rep.pool.connection_class is SSLConnection
    kw = rep.pool.connection_kwargs
    assert (kw["username"], kw["password"], kw["ssl_ca_certs"]) == ("hpd-index", "r3plica", CA)
    assert "r3plica" not in rep.name and rep.name.startswith("rediss://hpd-index:***@")  # what its logs show


def test_a_cluster_replica_gets_the_primary_urls_credentials_and_tls() -> None:
    port = free_port()
    url = "rediss://hpd-index:s3cret@127.0.0.1:6380/0?ssl_ca_certs=%s" % CA
    index = PrefixIndex(url, "m", cluster=True, read_replicas=True)
    rep = index._replica_at(("127.0.0.1", port))
    assert rep.pool.connection_class is SSLConnection
    kw = rep.pool.connection_kwargs
    assert (kw["username"], kw["password"], kw["ssl_ca_certs"], kw["port"]) == ("hpd-index", "s3cret", CA, port)
