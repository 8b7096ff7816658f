"""``bench index-scale`` end to end on a real redis-server, at a small size: the
JSON contract, the probes' exactness check, and the encodings measured."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from bench import index_scale
from hybridpd.hashing import BlockHasher

pytestmark = pytest.mark.integration


def test_a_small_run_writes_every_figure(tmp_path: Path) -> None:
    path = tmp_path / "index_scale.json"
    out = index_scale.run(path, quick=True, repeats=1, levels=(3_000, 12_000), rates=(500,), iterations=10)
    on_disk = json.loads(path.read_text())
    assert on_disk["checks"] == out["checks"] and path.with_suffix(".png").exists()
    assert list(out["levels"]) == ["m_3000", "m_12000"]
    top = out["levels"]["m_12000"]
    assert top["memberships"] >= 12_000 and top["store_entries"] > 0
    assert 30 < top["bytes_per_membership"] < 400  # a set member: digest + dict entry
    for n in index_scale.SIZES:
        r = top["tokens_%d" % n]
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["redis_cpu_ms_per_lookup"] > 0
    assert abs(sum(out["content"].values()) - 1.0) < 1e-9
    ladder = out["ingestion"]["ladder"]
    assert len(ladder) == 1 and ladder[0]["achieved_events_s"] > 0
    assert out["ingestion"]["redis_cpu_us_per_event"] > 0
    assert set(out["encodings"]) == set(index_scale.ENCODINGS)
    assert (
        out["encodings"]["set_per_instance_16B"]["bytes_per_membership"]
        < (out["encodings"]["set_per_instance"]["bytes_per_membership"])
    )
    key = "growth_p99_164000"
    assert out["checks"][key]["median"] == out[key] and out["checks"][key]["budget"] == index_scale.GROWTH_BUDGET
    assert "| memberships |" in path.with_suffix(".md").read_text()


def test_a_lookup_that_differs_from_the_placement_fails_the_run() -> None:
    """The probes' check can fail: one instance's entries removed behind the placement's back."""
    with tempfile.TemporaryDirectory() as tmp:
        srv, index = index_scale._fresh(Path(tmp))
        try:
            hasher = BlockHasher(unit=128, seed=index_scale.SEED)
            probes = index_scale.place_probes(index, hasher, 16_384, 128)
            index_scale.heartbeat_all(index)
            index_scale.decisions(index, hasher, probes, 128, 4, check=True)  # as placed: passes
            index.r.delete(index.keys.local_st(index_scale.NAMES[0]))
            with pytest.raises(AssertionError, match="differs from the placement"):
                index_scale.decisions(index, hasher, probes, 128, 4, check=True)
        finally:
            srv.stop()
