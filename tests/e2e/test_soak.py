"""The soak harness itself, briefly, on the session stack (the 10-minute run is
`hybridpd bench soak`; its numbers are in bench/README.md)."""

from __future__ import annotations

from bench.soak import SoakConfig, run_soak
from bench.soak import checks as check_soak
from tests.e2e.conftest import Stack


def test_short_soak_has_no_failures_and_returns_pools(stack: Stack, fp32_row_exact: None) -> None:
    cfg = SoakConfig(
        minutes=0.25,
        streams=3,
        prefix_lengths=(128, 512),
        suffixes_per_prefix=3,
        sample_every_s=2.0,
        reference_sample=4,
    )
    out = run_soak(stack.http, cfg)
    assert out["requests_ok"] >= 6, out
    assert out["requests_failed"] == 0, out["failures"]
    assert out["inconsistent_outputs"] == 0
    assert out["distinct_prompts"] < out["requests_ok"]  # prompts repeated, so consistency was checked
    assert out["pools_back_to_baseline"], out["pools_end"]
    assert out["cached_token_fraction"] > 0
    assert set(out["rss_mb_end"]) >= {"prefill-0", "prefill-1", "decode-0"}
    # a sample of the answers against a no-cache run of the same prompts, token for token
    assert out["reference_sampled"] == min(4, out["distinct_prompts"]) > 0
    assert out["reference_mismatches"] == 0, out["reference_mismatched_keys"]
    assert check_soak(out)["ok"]
