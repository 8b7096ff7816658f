"""The soak harness itself, briefly, on the session stack (the 10-minute run is
`hybridpd bench soak`; its numbers are in bench/README.md)."""

from __future__ import annotations

from bench.soak import SoakConfig, run_soak
from tests.e2e.conftest import Stack


def test_short_soak_has_no_failures_and_returns_pools(stack: Stack) -> None:
    cfg = SoakConfig(minutes=0.25, streams=3, prefix_lengths=(128, 512), suffixes_per_prefix=3, sample_every_s=2.0)
    out = run_soak(stack.http, cfg)
    assert out["requests_ok"] >= 6, out
    assert out["requests_failed"] == 0, out["failures"]
    assert out["inconsistent_outputs"] == 0
    assert out["distinct_prompts"] < out["requests_ok"]  # prompts repeated, so consistency was checked
    assert out["pools_back_to_baseline"], out["pools_end"]
    assert out["cached_token_fraction"] > 0
    assert set(out["rss_mb_end"]) >= {"prefill-0", "prefill-1", "decode-0"}
