"""NIXL handoff between two real processes: 64 MB verified, corruption
detected and never returned, a late reader gets a clean error."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from hybridpd.errors import IntegrityError
from hybridpd.transfer.nixl_handoff import HandoffClient, HandoffError
from tests.integration.store_worker import nixl_offer_worker


def _start(timeout_s: float, corrupt: bool):  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=nixl_offer_worker, args=(q_out, q_in, timeout_s, corrupt))
    p.start()
    return p, q_out, q_in, q_out.get(timeout=120)


def _finish(p, q_out, q_in) -> dict:  # type: ignore[no-untyped-def]
    q_in.put("report")
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
    stats = _finish(p, q_out, q_in)
    assert stats["released"] == 0  # never acknowledged: prefill keeps it until its timeout
    client.close()


def test_read_after_timeout_fails_cleanly() -> None:
    p, q_out, q_in, desc = _start(timeout_s=0.5, corrupt=False)
    time.sleep(1.0)
    client = HandoffClient("decode-test-3")
    with pytest.raises(HandoffError, match="expired"):
        client.fetch(desc)
    # even ignoring the expiry, the freed (scrubbed) buffers never pass verification
    late = desc.__class__(
        desc.handoff_id, desc.agent_name, desc.agent_metadata, desc.descs, desc.buffers, time.time() + 60
    )
    with pytest.raises((HandoffError, IntegrityError)):
        client.fetch(late)
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
    deadline = time.monotonic() + 5
    while server.outstanding() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.outstanding() == 0 and server.expired == 1
    assert float(buf.abs().sum()) == 0.0  # zeroed before release
    server.close()
