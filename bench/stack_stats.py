"""What the benchmarks read from a running stack's ``/v1/hybridpd/stats``."""

from __future__ import annotations

import httpx


def handoff_counters(client: httpx.Client, url: str) -> tuple[int, int] | None:
    """The decode actors' handoff bytes ``(read, not read)``, summed: ``nixl_read_bytes``
    and ``handoff_skipped_bytes`` (blocks decode held: delta handoffs). None where
    ``url`` is not our stack (plain vLLM has no such endpoint)."""
    resp = client.get(url + "/v1/hybridpd/stats", timeout=60)
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    decode = [s for name, s in resp.json().items() if name.startswith("decode")]
    read = sum(int(s.get("nixl_read_bytes", 0)) for s in decode)
    return read, sum(int(s.get("handoff_skipped_bytes", 0)) for s in decode)
