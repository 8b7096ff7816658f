"""bench router / bench.hashing without Redis: the baseline and its label, budgets on
medians, and the markdown rendered from a small synthetic result."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

from click.testing import CliRunner

from bench import hashing, router, vllm_chain
from bench.repeats import aggregate
from hybridpd.hashing import BlockHasher, HashAlgo
from launch.cli import cli

VLLM = {"kind": "vllm", "vllm_version": "0.32.0+cpu", "function": "vllm...get_request_block_hasher(128, sha256)"}
COPY = {"kind": "copy", "vllm_version": None, "function": "bench.vllm_chain.vllm_chain", "copy_of": "x"}


def _tokens(n: int = 5 * 16 + 3) -> list[int]:
    rng = random.Random(n)
    return [rng.choice([0, 23, 24, 255, 256, 65535, 65536, rng.randrange(1 << 31)]) for _ in range(n)]


def test_copy_baseline_is_labelled_a_copy_and_equals_our_chain() -> None:
    for algo in HashAlgo:
        base = vllm_chain.baseline(_tokens(), 16, "bench", algo, allow_vllm=False)
        assert base.kind == "copy"
        assert base.chain() == BlockHasher(unit=16, algo=algo, seed="bench").chain(_tokens())
        d = base.describe()
        assert d["kind"] == "copy" and d["vllm_version"] is None and "hash_block_tokens" in d["copy_of"]
        assert d["cbor2_version"]  # the copy's cost is mostly cbor2's
        assert vllm_chain.label(d) == "copy of vLLM's hash_block_tokens"


def test_default_baseline_is_vllm_exactly_where_vllm_imports() -> None:
    base = vllm_chain.baseline(_tokens(), 16, "bench")
    if importlib.util.find_spec("vllm") is None:
        assert base.kind == "copy" and base.vllm_version is None
    else:  # the vLLM environment: vLLM's own request block hasher, labelled with its version
        assert base.kind == "vllm" and base.vllm_version
        assert "get_request_block_hasher" in base.function
        assert vllm_chain.label(base.describe()).startswith("vLLM %s" % base.vllm_version)
    assert base.chain() == BlockHasher(unit=16, seed="bench").chain(_tokens())


def test_label_names_vllm_and_its_version() -> None:
    assert vllm_chain.label(VLLM) == "vLLM 0.32.0+cpu's own hasher"
    assert "0.32.0+cpu" in router.baseline_line(VLLM) and "get_request_block_hasher" in router.baseline_line(VLLM)
    assert "copy" in router.baseline_line(COPY)
    assert "cbor2 6.3.0" in router.baseline_line({**VLLM, "cbor2_version": "6.3.0"})


def test_budget_check_is_judged_on_the_median() -> None:
    c = router.budget_check([0.08, 0.12, 0.09, 0.15, 0.11], 0.1)
    assert c["median"] == 0.11 and not c["met"]
    assert (c["repeats_met"], c["repeats"], c["min"], c["max"]) == (2, 5, 0.08, 0.15)
    assert router.budget_check([0.08, 0.12, 0.09], 0.1)["met"]


def test_fmt_range() -> None:
    assert router.fmt_range(3.05, 2.98, 3.2) == "3.05 (2.98-3.20)"
    assert router.fmt_range(3.05, 3.049, 3.051) == "3.05"  # equal as printed: no range


def _size(p50: float, p99: float, base: float) -> dict[str, Any]:
    return {
        "blocks": 1281,
        "p50_ms": p50,
        "p99_ms": p99,
        "chain_p50_ms": 1.0,
        "lookup_p50_ms": 1.5,
        "lookup_p99_ms": 2.0,
        "baseline_p50_ms": base,
        "baseline_runs": 30,
        "ratio_p50_vs_baseline": p50 / base,
        "ratio_p99_vs_baseline": p99 / base,
        "cpu_p50_ms": 2.0,
        "cpu_p99_ms": 3.0,
        "baseline_cpu_p50_ms": base,
        "cpu_ratio_p99_vs_baseline": 3.0 / base,
    }


def _router_out(baseline: dict[str, Any]) -> dict[str, Any]:
    reps = [
        {"results": {"tokens_164000": _size(3.05, 4.0, 50.0)}},
        {"results": {"tokens_164000": _size(2.98, 6.0, 50.0)}},
        {"results": {"tokens_164000": _size(3.20, 5.0, 50.0)}},
    ]
    ratios = [r["results"]["tokens_164000"]["ratio_p99_vs_baseline"] for r in reps]
    return {
        "unit": 128,
        "iterations": 300,
        "baseline_every": 10,
        "baseline": baseline,
        **aggregate(reps),
        "repeats": reps,
        "repeat_count": 3,
        "checks": {"ratio_p99_vs_baseline_164000": router.budget_check(ratios, 0.1)},
    }


def test_router_markdown_shows_medians_ranges_baseline_and_checks() -> None:
    md = router.markdown(_router_out(VLLM))
    assert "3 repeats of 300 decisions" in md
    assert "| 164,000 tokens | 1,281 | 3.05 (2.98-3.20) | 5.00 (4.00-6.00) | 1.00 | 1.50 | 50.0 |" in md
    assert "vLLM 0.32.0+cpu's own hasher p50 ms" in md and "vLLM 0.32.0+cpu" in md
    # p99 / baseline: 0.08, 0.12, 0.10 -> median 0.100 meets <= 0.1; two of three repeats met it
    assert "| <= 0.100 | 0.100 (0.080-0.120) | met | 2 of 3 |" in md
    copy = router.markdown(_router_out(COPY))
    assert "copy of vLLM's hash_block_tokens p50 ms" in copy and "vLLM 0.32" not in copy


def test_hashing_markdown() -> None:
    def rep(ours: float, base: float) -> dict[str, Any]:
        r = {
            "blocks": 1281,
            "ours_ms_p50": ours,
            "ours_list_input_ms_p50": ours,
            "baseline_ms_p50": base,
            "baseline_runs": 6,
            "speedup": base / ours,
            "speedup_list_input": base / ours,
        }
        return {"results": {"sha256_cbor": r}}

    reps = [rep(1.0, 50.0), rep(1.0, 60.0)]
    out = {"tokens": 164_000, "unit": 128, "iterations": 30, "baseline": COPY, **aggregate(reps)}
    out.update(repeats=reps, repeat_count=2)
    md = hashing.markdown(out)
    assert "2 repeats of 30 timed chains per algorithm, 164,000 tokens at unit 128" in md
    assert "| sha256_cbor | 1,281 | 1.00 | 1.00 | 55.0 (50.0-60.0) | x55.0 (50.0-60.0) |" in md
    assert "copy of vLLM's hash_block_tokens ms" in md


def test_cli_help_names_repeats_and_iterations() -> None:
    got = CliRunner().invoke(cli, ["bench", "router", "--help"])
    assert got.exit_code == 0
    for flag in ("--repeats", "--iterations", "--copy", "get_request_block_hasher"):
        assert flag in got.output


def test_a_result_from_before_repeats_renders_a_rerun_note() -> None:
    old = {"unit": 128, "iterations": 300, "results": {}, "checks": {"ratio_ok": True}}
    for md in (router.markdown(old), hashing.markdown(old)):
        assert "predates repeats" in md and "rerun" in md
