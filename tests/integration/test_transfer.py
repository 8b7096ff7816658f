"""NIXL handoff between two real processes: 64 MB verified, corruption
detected and never returned, a late reader gets a clean error; the agents run
without NIXL's progress thread, so an idle server burns no CPU, and releases
(large handoffs, many in flight, two readers at once) are still noticed within
milliseconds."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import statistics
import threading
import time

import pytest
import torch

from hybridpd.errors import IntegrityError
from hybridpd.integrity import HANDOFF, PUBLIC, IntegrityKey, TagError
from hybridpd.transfer.handoff_descriptor import HandoffError, tag_descriptor
from hybridpd.transfer.nixl_handoff import HandoffClient
from tests.integration.store_worker import nixl_offer_worker, nixl_server_worker
from tests.wait import Pending, wait_until


def _start(timeout_s: float, corrupt: bool, chunk_rows: int = 0):  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=nixl_offer_worker, args=(q_out, q_in, timeout_s, corrupt, chunk_rows))
    p.start()
    return p, q_out, q_in, q_out.get(timeout=120)


def _finish(p, q_out, q_in, held: bool = False) -> dict:  # type: ignore[no-untyped-def]
    """The offer's counters once it is released or expired (``held``: while it must stay held)."""
    q_in.put("report-held" if held else "report")
    stats = q_out.get(timeout=60)
    q_in.put("exit")
    p.join(60)
    assert p.exitcode == 0
    return stats


def test_64mb_read_verified_and_released() -> None:
    p, q_out, q_in, desc = _start(timeout_s=60, corrupt=False)
    client = HandoffClient("decode-test")
    big, state = client.fetch(desc)
    assert big.numel() == 64 << 20
    assert torch.equal(big, torch.arange(64 << 20, dtype=torch.int64).remainder(253).to(torch.uint8))
    assert torch.equal(state, torch.randn(6, 4, 64, 64, generator=torch.Generator().manual_seed(2)))
    stats = _finish(p, q_out, q_in)
    assert stats == {"outstanding": 0, "released": 1, "expired": 0}
    client.close()


def test_corrupted_buffer_detected() -> None:
    p, q_out, q_in, desc = _start(timeout_s=60, corrupt=True)
    client = HandoffClient("decode-test-2")
    with pytest.raises(IntegrityError, match="checksum"):
        client.fetch(desc)
    stats = _finish(p, q_out, q_in, held=True)
    assert stats["released"] == 0  # never acknowledged: prefill keeps it until its timeout
    client.close()


def test_a_reader_with_another_key_refuses_the_offer_before_reading_it() -> None:
    """The offer is tagged with the public key; a decode holding a deployment key
    refuses it (TagError) without a READ: prefill never sees a release."""
    p, q_out, q_in, desc = _start(timeout_s=60, corrupt=False)
    client = HandoffClient("decode-test-key", key=IntegrityKey(b"a deployment key the offer lacks"))
    with pytest.raises(TagError, match="keyed tag"):
        client.fetch(desc)
    assert client.remotes == {}  # the prefill agent was never loaded
    stats = _finish(p, q_out, q_in, held=True)
    assert stats["released"] == 0 and stats["outstanding"] == 1
    client.close()


def test_a_reader_skips_the_chunks_it_holds() -> None:
    """A delta handoff: the 64 MiB buffer is offered in 1 MiB chunks; the reader skips
    chunk 0 (it holds it; the corrupted byte lies there, so its checksum is never
    asked) and reads and verifies the other 63 only."""
    mib = 1 << 20
    p, q_out, q_in, desc = _start(timeout_s=60, corrupt=True, chunk_rows=mib)
    big = desc.buffers[0]
    assert big.chunk_rows == mib and len(big.chunk_xxh3) == 64 and big.xxh3 == ""
    assert desc.read_bytes(frozenset({0})) == desc.nbytes - mib
    assert big.kept_ranges(frozenset({0, 5})) == [(mib, 5 * mib), (6 * mib, 64 * mib)]
    client = HandoffClient("decode-test-skip")
    got = client.fetch(desc, skip_chunks=frozenset({0}))
    want = torch.arange(64 << 20, dtype=torch.int64).remainder(253).to(torch.uint8)
    assert torch.equal(got[0][mib:], want[mib:])
    stats = _finish(p, q_out, q_in)
    assert stats["released"] == 1 and stats["outstanding"] == 0
    client.close()


def test_read_after_timeout_fails_cleanly() -> None:
    p, q_out, q_in, desc = _start(timeout_s=0.5, corrupt=False)
    time.sleep(1.0)  # the scenario: a reader that comes after the 0.5 s timeout
    # NOTE: a READ of freed buffers does not complete: it ends at the client's read timeout,
    # 2 s here (30 by default), a HandoffError all the same
    client = HandoffClient("decode-test-3", read_timeout_s=2.0)
    with pytest.raises(HandoffError, match="expired"):
        client.fetch(desc)
    # a descriptor whose expiry was moved fails its tag before anything is read
    late = dataclasses.replace(desc, expires_at=time.time() + 60)
    with pytest.raises(TagError):
        client.fetch(late)
    # and even re-tagged with the offer's key (the public one here), the freed (scrubbed)
    # buffers never pass verification
    with pytest.raises((HandoffError, IntegrityError)) as exc:
        client.fetch(tag_descriptor(late, PUBLIC.tagger(HANDOFF)))
    assert not isinstance(exc.value, TagError)
    stats = _finish(p, q_out, q_in)
    assert stats["outstanding"] == 0 and stats["expired"] == 1
    client.close()


def test_expired_inference_tensors_are_scrubbed_and_freed() -> None:
    """Engine buffers are inference-mode tensors; expiry must still scrub and free them."""
    from hybridpd.transfer.nixl_handoff import HandoffServer

    server = HandoffServer("prefill-scrub", timeout_s=0.2)
    with torch.inference_mode():
        buf = torch.ones(1024)
    server.offer([buf])
    wait_until(lambda: server.outstanding() == 0, 5, what="the offer to expire (timeout 0.2 s)")
    assert server.expired == 1
    assert float(buf.abs().sum()) == 0.0  # zeroed before release
    server.close()


class _Server:
    """A HandoffServer in its own process (``nixl_server_worker``)."""

    def __init__(self, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.q_out, self.q_in = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=nixl_server_worker, args=(self.q_out, self.q_in, timeout_s))
        self.proc.start()
        assert self.q_out.get(timeout=120) == "ready"

    def call(self, cmd: str, arg: object = None):  # type: ignore[no-untyped-def]
        self.q_in.put((cmd, arg))
        return self.q_out.get(timeout=120)

    def settled(self, timeout_s: float, what: str) -> dict:
        """The report once no offer is outstanding (each released or expired)."""

        def report() -> dict | Pending:
            rep = self.call("report")
            return rep if rep["outstanding"] == 0 else Pending(rep)

        return wait_until(report, timeout_s, 0.01, what)

    def idle_cpu_s(self, seconds: float) -> float:
        before = self.call("report")["cpu_s"]
        time.sleep(seconds)  # the measurement window
        return self.call("report")["cpu_s"] - before

    def close(self) -> None:
        assert self.call("exit") == "bye"
        self.proc.join(60)
        assert self.proc.exitcode == 0


@pytest.mark.parametrize("tls", [None, "tcp"])
def test_idle_server_uses_no_cpu_and_releases_are_noticed_within_milliseconds(
    tls: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if tls is not None:  # TCP: the target side of a READ and the notification need the peers' progress
        monkeypatch.setenv("UCX_TLS", tls)
    server = _Server(timeout_s=60)
    try:
        assert server.idle_cpu_s(2.0) < 0.02  # no progress thread, no polling without offers
        client = HandoffClient("decode-idle")
        sizes = [64 << 20] + [1 << 20] * 20 + [4096] * 20
        descs = server.call("offer", sizes)
        done: dict[str, float] = {}
        for desc in descs:
            bufs = client.fetch(desc)
            done[desc.handoff_id] = time.time()  # fetch returns right after its release notification
            del bufs
        # fetch returned after its release notification was sent; the server notices it in a moment
        rep = server.settled(10, "every release noticed")
        assert (rep["outstanding"], rep["released"], rep["expired"]) == (0, len(sizes), 0)
        lag_ms = [(rep["released_at"][h] - t) * 1000 for h, t in done.items()]
        # the server polls every 1 ms while offers are outstanding; the bound on the worst case
        # leaves room for a loaded 2-core machine's scheduling
        assert statistics.median(lag_ms) < 5, lag_ms
        assert max(lag_ms) < 100, lag_ms
        assert server.idle_cpu_s(2.0) < 0.02  # back to idle once every offer is freed
        client.close()
    finally:
        server.close()


def test_many_in_flight_from_two_readers_all_verified_and_released() -> None:
    server = _Server(timeout_s=60)
    try:
        sizes = [8 << 20] * 4 + [256 << 10] * 60
        descs = server.call("offer", sizes)
        assert server.call("report")["outstanding"] == len(sizes)
        errors: list[BaseException] = []

        def read(part: list) -> None:  # type: ignore[type-arg]
            client = HandoffClient("decode-many-%d" % threading.get_ident())
            try:
                for desc in part:
                    (buf,) = client.fetch(desc)
                    assert buf.numel() == desc.nbytes
            except BaseException as exc:  # reported to the test thread
                errors.append(exc)
            finally:
                client.close()

        threads = [threading.Thread(target=read, args=(descs[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        rep = server.settled(5, "every release noticed")
        assert (rep["outstanding"], rep["released"], rep["expired"]) == (0, len(sizes), 0)
    finally:
        server.close()


def test_unread_offers_expire_and_the_server_goes_idle() -> None:
    server = _Server(timeout_s=0.5)
    try:
        server.call("offer", [1 << 20] * 5)
        rep = server.settled(5, "the offers to expire (timeout 0.5 s)")
        assert (rep["outstanding"], rep["released"], rep["expired"]) == (0, 0, 5)
        assert server.idle_cpu_s(2.0) < 0.02
    finally:
        server.close()
