"""Separate processes for store and NIXL tests (spawned; no shared state)."""

from __future__ import annotations

import time
from typing import Any

import torch

from tests.wait import wait_until


def store_put_worker(master: str, metadata_url: str, model: str, q_out: Any, q_in: Any) -> None:
    from hybridpd.store.client import CheckpointStore

    store = CheckpointStore(master, metadata_url, model)
    big = torch.arange(64 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
    small = [torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(1)) for _ in range(4)]
    store.put_objects([("hpd/%s/blob/big" % model, "blob", 0, [big]), ("hpd/%s/blob/small" % model, "blob", 7, small)])
    q_out.put("stored")
    q_in.get(timeout=120)  # keep the segment (and so the objects) alive until the reader is done
    store.close()


def nixl_offer_worker(q_out: Any, q_in: Any, timeout_s: float, corrupt: bool, chunk_rows: int = 0) -> None:
    """Offers 64 MiB (a byte pattern, ``chunk_rows`` > 0: checksummed in chunks of that
    many bytes) and a state-like buffer; ``corrupt`` flips byte 12345 after the checksum."""
    from hybridpd.transfer.nixl_handoff import HandoffServer

    server = HandoffServer("prefill-test", timeout_s=timeout_s)
    big = torch.arange(64 << 20, dtype=torch.int64).remainder(253).to(torch.uint8)
    state = torch.randn(6, 4, 64, 64, generator=torch.Generator().manual_seed(2))
    desc = server.offer([big, state], chunk_rows=[chunk_rows])
    if corrupt:
        big[12345] ^= 0xFF  # after the checksum was taken: a corrupted buffer
    q_out.put(desc)
    if q_in.get(timeout=120) == "report":  # the reader is done: wait until its release (or the expiry) is noticed
        wait_until(lambda: server.outstanding() == 0, 10, 0.01, "the offer released or expired")
    else:  # "report-held": the offer must stay held; no message says a (wrong) release will not come
        time.sleep(0.2)
    q_out.put({"outstanding": server.outstanding(), "released": server.released, "expired": server.expired})
    q_in.get(timeout=120)
    server.close()


def nixl_server_worker(q_out: Any, q_in: Any, timeout_s: float) -> None:
    """A prefill-side HandoffServer driven by commands: ("offer", [nbytes, ...]) offers one
    buffer each (a byte pattern) and answers the descriptors; ("report", None) answers the
    counters, this process's CPU seconds and when each release was noticed; ("exit", None)."""
    from hybridpd.transfer.nixl_handoff import HandoffServer

    released_at: dict[str, float] = {}

    class TimedServer(HandoffServer):
        def _free(self, hid: str, scrub: bool, outcome: str | None = None) -> float | None:
            noticed = time.time()
            with self.lock:  # reentrant: recorded before a report can see the counters move
                offered = super()._free(hid, scrub, outcome)
                if offered is not None and not scrub:
                    released_at[hid] = noticed
            return offered

    server = TimedServer("prefill-srv", timeout_s=timeout_s)
    q_out.put("ready")
    while True:
        cmd, arg = q_in.get(timeout=300)
        if cmd == "offer":
            q_out.put([server.offer([torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)]) for n in arg])
        elif cmd == "report":
            q_out.put(
                {
                    "outstanding": server.outstanding(),
                    "released": server.released,
                    "expired": server.expired,
                    "released_at": dict(released_at),
                    "cpu_s": time.process_time(),
                }
            )
        else:
            server.close()
            q_out.put("bye")
            return
