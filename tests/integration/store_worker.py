"""Separate processes for store and NIXL tests (spawned; no shared state)."""

from __future__ import annotations

import time
from typing import Any

import torch


def store_put_worker(master: str, metadata_url: str, model: str, q_out: Any, q_in: Any) -> None:
    from hybridpd.store.client import CheckpointStore

    store = CheckpointStore(master, metadata_url, model)
    big = torch.arange(64 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
    small = [torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(1)) for _ in range(4)]
    store.put_objects([("hpd/%s/blob/big" % model, "blob", 0, [big]), ("hpd/%s/blob/small" % model, "blob", 7, small)])
    q_out.put("stored")
    q_in.get(timeout=120)  # keep the segment (and so the objects) alive until the reader is done
    store.close()


def nixl_offer_worker(q_out: Any, q_in: Any, timeout_s: float, corrupt: bool) -> None:
    from hybridpd.transfer.nixl_handoff import HandoffServer

    server = HandoffServer("prefill-test", timeout_s=timeout_s)
    big = torch.arange(64 << 20, dtype=torch.int64).remainder(253).to(torch.uint8)
    state = torch.randn(6, 4, 64, 64, generator=torch.Generator().manual_seed(2))
    desc = server.offer([big, state])
    if corrupt:
        big[12345] ^= 0xFF  # after the checksum was taken: a corrupted buffer
    q_out.put(desc)
    q_in.get(timeout=120)
    time.sleep(0.2)
    q_out.put({"outstanding": server.outstanding(), "released": server.released, "expired": server.expired})
    q_in.get(timeout=120)
    server.close()
