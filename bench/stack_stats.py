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


def prefill_computed(client: httpx.Client, url: str) -> dict[str, int] | None:
    """Prompt tokens each prefill instance has computed (``prefill_computed_tokens``);
    None where ``url`` is not our stack."""
    resp = client.get(url + "/v1/hybridpd/stats", timeout=60)
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    return {n: int(s.get("prefill_computed_tokens", 0)) for n, s in resp.json().items() if n.startswith("prefill")}


def load_spread(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, float] | None:
    """How the work between two ``prefill_computed`` readings spread over the prefill
    instances: each one's share of the computed tokens, and ``max_share`` (1 / the
    number of instances when even; 1.0 when one instance did everything: herding)."""
    if before is None or after is None:
        return None
    delta = {n: after[n] - before.get(n, 0) for n in after}
    total = sum(delta.values())
    shares = {n: (d / total if total else 0.0) for n, d in sorted(delta.items())}
    return {**{"share_" + n: v for n, v in shares.items()}, "max_share": max(shares.values(), default=0.0)}


def prefill_cache(client: httpx.Client, url: str) -> dict[str, float] | None:
    """What the prefill instances' engines hold in their prefix caches now, summed
    over the instances: ``cached_blocks`` (``PoolStats.num_cached_blocks``: on
    vLLM its prefix-cache entries, one per (hash, group) key, KV and recurrent
    state alike; a block that holds a partial entry besides its full one counts
    twice) and ``cached_mib`` (those at ``PoolStats.block_bytes`` each); None
    where ``url`` is not our stack."""
    resp = client.get(url + "/v1/hybridpd/stats", timeout=60)
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    pools = [s["pool"] for n, s in resp.json().items() if n.startswith("prefill")]
    blocks = sum(int(p.get("num_cached_blocks", 0)) for p in pools)
    nbytes = sum(int(p.get("num_cached_blocks", 0)) * int(p.get("block_bytes", 0)) for p in pools)
    return {"cached_blocks": float(blocks), "cached_mib": nbytes / 2**20}
