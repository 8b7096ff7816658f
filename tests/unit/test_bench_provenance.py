"""bench/provenance.py names the machine, and no comparison crosses machines,
commits or sittings: ``same_run`` requires one machine, the checks that compare
variants read "not comparable" otherwise, and bench/tables.py never puts two
machine kinds in one table."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import provenance, tables
from bench.provenance import NOT_COMPARABLE

pytestmark = pytest.mark.unit

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 sha_ni
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 sha_ni
"""

AVX2 = {"cpu": "AMD EPYC", "cpu_flags": ["avx2"], "machine_id": "m-avx2", "cpus": 2}
AVX512 = {"cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512f"], "machine_id": "m-avx512", "cpus": 2}


def rec(started: float, machine: dict[str, Any] | None = AVX2, commit: str = "c0", dirty: bool = False) -> dict:
    r = {
        "commit": commit,
        "dirty": dirty,
        "started": started,
        "started_utc": "2001-09-09 01:46:40 UTC",
        "ended": started + 60.0,
        "ended_utc": "2001-09-09 01:47:40 UTC",
        "load_average_before": [0.5, 0.4, 0.3],
        "load_average_after": [0.7, 0.5, 0.3],
        "versions": {"python": "3.11.7"},
    }
    if machine is not None:
        r["machine"] = machine
    return r


def test_the_machine_is_named_by_its_cpu_flags_and_a_hashed_id(monkeypatch: pytest.MonkeyPatch) -> None:
    assert provenance.parse_cpuinfo(CPUINFO) == ("AMD EPYC 7B13", ["avx2", "avx512f", "avx512_bf16"])
    m = provenance.machine()
    for key in ("cpu", "cpu_flags", "torch_cpu_capability", "cpus", "memory_gib", "kernel", "machine_id"):
        assert key in m, key
    assert set(m["cpu_flags"]) <= set(provenance.CPU_FLAGS)
    assert provenance.has_machine(provenance.begin().to_dict())
    # a hash, never the raw id; stable; another raw id, CPU or flag set is another machine
    one = provenance.machine_id("AMD EPYC", ["avx2"], 62.8, raw_id="0123456789abcdef")
    assert one == provenance.machine_id("AMD EPYC", ["avx2"], 62.8, raw_id="0123456789abcdef")
    assert "0123456789abcdef" not in one and len(one) == 16
    assert one != provenance.machine_id("AMD EPYC", ["avx2"], 62.8, raw_id="fedcba9876543210")
    assert one != provenance.machine_id("AMD EPYC", ["avx2", "avx512f"], 62.8, raw_id="0123456789abcdef")
    assert provenance.machine_id("AMD EPYC", [], None, raw_id="") != provenance.machine_id("Xeon", [], None, raw_id="")
    # torch is optional: without it the capability is None
    monkeypatch.setitem(sys.modules, "torch", None)
    assert provenance.torch_cpu_capability() is None


def test_a_machine_kind_is_the_cpu_model_with_its_flags() -> None:
    assert provenance.machine_kind(AVX2) == "AMD EPYC (avx2)"
    assert provenance.machine_kind(AVX512) == "AMD EPYC (avx2 avx512f)"
    assert provenance.machine_kind({"cpu": "AMD EPYC", "cpus": 2}) == "AMD EPYC (CPU flags not recorded)"
    assert "none of avx2" in provenance.machine_kind({"cpu": "Old", "cpu_flags": [], "machine_id": "x"})


def test_same_run_requires_one_machine_one_clean_commit_and_one_sitting() -> None:
    assert provenance.same_run([rec(0), rec(70), rec(140)])
    assert not provenance.same_run([rec(0), rec(70, AVX512)])
    assert provenance.difference([rec(0), rec(70, AVX512)]) == "machines differ"
    assert not provenance.same_run([rec(0), rec(70, None)])  # a record without its machine
    assert provenance.difference([rec(0, None)]) == "a record names no machine"
    assert provenance.difference([rec(0), rec(70, commit="c1")]) == "commits differ"
    assert provenance.difference([rec(0), rec(70, dirty=True)]) == "a dirty tree"
    assert provenance.difference([rec(0), rec(60 + provenance.SAME_RUN_MAX_GAP_S + 1)]) == "not one sitting"
    assert provenance.same_machine([rec(0), rec(9999, commit="c1")])  # an A/B across commits: one machine
    assert not provenance.same_machine([rec(0), rec(1, AVX512)]) and not provenance.same_machine([])


def test_a_variant_without_provenance_is_comparable_with_none() -> None:
    ours, theirs = {"provenance": [rec(0)]}, {"provenance": [rec(70)]}
    assert provenance.variants_same_run([ours, theirs])
    assert not provenance.variants_same_run([ours, {"provenance": []}])
    assert not provenance.variants_same_run([ours, {}])
    assert provenance.variants_difference([ours, {}]) == "a variant has no provenance"
    assert provenance.judged(True, {"r": 0.5}) == {"r": 0.5}
    assert provenance.judged(False, {"r": 0.5, "ok": True}) == {"r": NOT_COMPARABLE, "ok": NOT_COMPARABLE}


def _phases(ttft: float, hit: float = 1.0) -> dict:
    return {p: {"hit_ratio": hit, "ttft_p50_ms": ttft, "cached_tokens": 100} for p in ("fanout_ids", "tree_ids")}


def _sp_variant(ttft: float, machine: dict | None = AVX2, started: float = 0.0, **extra: Any) -> dict:
    provs = [rec(started, machine)] if machine is not None else []
    return {"phases": _phases(ttft), "prompt_tokens_match": True, "provenance": provs, **extra}


def test_shared_prefix_comparisons_read_not_comparable_across_machines() -> None:
    from bench.shared_prefix_checks import checks

    held = {"prefill_cache": {"cached_mib": 90.0}, "hit_ratio_all_phases": 0.95}
    one = {
        "stack-vllm": _sp_variant(50.0, **held),
        "stack-vllm-retain-dense": _sp_variant(60.0, started=70.0, **held),
        "vllm-pd": _sp_variant(100.0, started=140.0),
    }
    out = checks(one)
    assert out["stack_vllm_same_run"] and out["stack_vllm_ttft_p50_vs_vllm_pd"] == {"fanout_ids": 0.5, "tree_ids": 0.5}
    assert out["stack_vllm_ttft_below_vllm_pd"] is True and out["retention_dense_hit_ratio"] == 1.0
    # vllm-pd re-measured on another machine: every comparison with it reads "not comparable"
    other = {**one, "vllm-pd": _sp_variant(1000.0, AVX512, started=140.0)}
    out = checks(other)
    assert not out["stack_vllm_same_run"]
    for key in ("ttft_p50_vs_vllm_pd", "ttft_below_vllm_pd", "plan_ttft_below_vllm_pd", "cached_not_above_vllm_pd"):
        assert out.get("stack_vllm_" + key, NOT_COMPARABLE) == NOT_COMPARABLE, key
    assert out["stack_vllm_above_vllm"] == NOT_COMPARABLE
    assert out["retention_dense_hit_ratio"] == 1.0  # those two are still one run
    # a variant without provenance is comparable with none
    bare = {**one, "stack-vllm-retain-dense": _sp_variant(60.0, machine=None, **held)}
    assert checks(bare)["retention_dense_cached_mib_ratio"] == NOT_COMPARABLE


def test_multi_turn_against_vllm_pd_reads_not_comparable_across_machines() -> None:
    from bench.multi_turn_checks import _against_vllm_pd

    def v(ttft: float, cached: float, machine: dict | None) -> dict:
        provs = [rec(0.0, machine)] if machine else []
        return {
            "ttft_p50_ms": ttft,
            "cached_tokens_per_request": cached,
            "prompt_tokens_per_request": 100.0,
            "provenance": provs,
        }

    same = _against_vllm_pd(v(50.0, 88.0, AVX2), v(100.0, 63.0, AVX2))
    assert same["stack_vllm_ttft_p50_vs_vllm_pd"] == 0.5 and same["stack_vllm_cached_above_vllm_pd"] is True
    other = _against_vllm_pd(v(50.0, 88.0, AVX2), v(100.0, 63.0, AVX512))
    assert other["stack_vllm_ttft_below_vllm_pd"] == NOT_COMPARABLE
    assert other["stack_vllm_cached_above_vllm_pd"] == NOT_COMPARABLE
    assert other["stack_vllm_cached_share"] == 0.88 and other["vllm_pd_cached_share"] == 0.63  # each its own
    assert _against_vllm_pd(v(50.0, 88.0, AVX2), v(100.0, 63.0, None))["stack_vllm_ttft_p50_vs_vllm_pd"] == (
        NOT_COMPARABLE
    )


def _gs_variant(ttft: float, machine: dict | None, started: float, **vs: Any) -> dict:
    fields = {
        "cached_tokens_per_request": 900.0,
        "recomputed_tokens_per_request": 100.0,
        "ideal_tokens_per_request": 100.0,
        "recompute_over_ideal": 1.0,
        "ttft_p50_ms": ttft,
        "ttft_p90_ms": ttft * 2,
        "throughput_tokens_per_s": 1000.0,
        "repeat_count": 1,
    }
    provs = [rec(started, machine)] if machine else []
    return {**fields, **vs, "provenance": provs}


def _growing(tmp: Path, machines: tuple[dict | None, dict | None]) -> str:
    ratio = {"recomputed_tokens": 1.0, "ttft_p50": 0.5, "throughput": 2.0}
    out = {
        "variants": {
            "partial": _gs_variant(50.0, machines[0], 0.0, vs_nocache=ratio),
            "nocache": _gs_variant(100.0, machines[1], 70.0),
        },
        "checks": {"partial_ok": True, "partial_caches_more_than_aligned": True, "routers_hit_rate_ok": True},
    }
    (tmp / "growing_streams_quick.json").write_text(json.dumps(out))
    return tables.render_block("growing-streams-quick", tmp)


def test_tables_put_one_machine_kind_in_a_table_and_judge_only_one_run(tmp_path: Path) -> None:
    text = _growing(tmp_path, (AVX2, AVX2))
    assert text.count("`growing_streams_quick.json`: run") == 1 and "the variants are one run" in text
    assert "against the baselines of the same run" in text and "| variant | / nocache |" in text
    assert "| partial | 0.500 |" in text
    assert "`partial_caches_more_than_aligned` holds" in text

    text = _growing(tmp_path, (AVX2, AVX512))
    tables_ = text.split("`growing_streams_quick.json`: run")[1:]
    assert len(tables_) == 2, "one table per machine kind"
    assert "AMD EPYC (avx2)," in tables_[0] and "| partial |" in tables_[0] and "| nocache |" not in tables_[0]
    assert "AMD EPYC (avx2 avx512f)" in tables_[1] and "| nocache |" in tables_[1] and "| partial |" not in tables_[1]
    assert "against the baselines" not in text and "1 ratios against a baseline left out" in text
    assert "`partial_caches_more_than_aligned` not comparable" in text and "`partial_ok` holds" in text
    assert "`routers_hit_rate_ok` not comparable" in text

    # records from before the machine was recorded: one kind that cannot be told apart, nothing comparable
    text = _growing(tmp_path, ({"cpu": "AMD EPYC", "cpus": 2}, {"cpu": "AMD EPYC", "cpus": 2}))
    assert "AMD EPYC (CPU flags not recorded)" in text and "**not** one run (a record names no machine)" in text
    assert "`partial_caches_more_than_aligned` not comparable" in text
    # a variant without provenance makes the file not one run
    assert "(a variant has no provenance)" in _growing(tmp_path, (AVX2, None))


def test_a_same_run_check_stored_before_the_machine_was_recorded_is_recomputed(tmp_path: Path) -> None:
    legacy = {"cpu": "AMD EPYC", "cpus": 2}
    out = {
        "variants": {"partial": _gs_variant(50.0, legacy, 0.0), "nocache": _gs_variant(90.0, legacy, 70.0)},
        "checks": {"same_run": True, "done_when": True},
    }
    (tmp_path / "growing_streams_quick.json").write_text(json.dumps(out))
    text = tables.render_block("growing-streams-quick", tmp_path)
    assert "`same_run` **MISSED** (a record names no machine)" in text and "`done_when` not comparable" in text
