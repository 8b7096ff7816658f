"""bench overhead without a stack: the per-token ITL / per-request TPOT rule, the
budgets on medians, and the markdown rendered from a small synthetic result."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from bench import overhead, router
from bench.repeats import aggregate
from launch.cli import cli


def test_a_three_token_chunk_is_one_gap_and_two_zeros() -> None:
    got = overhead._timing(0.5, [(1.0, 1), (1.5, 3), (2.0, 1)])
    assert got["ttft_s"] == 0.5
    assert got["itl_s"] == [0.5, 0.0, 0.0, 0.5]
    assert got["chunk_gaps_s"] == [0.5, 0.5]  # vLLM's client: one ITL per chunk
    assert got["tpot_s"] == pytest.approx((2.0 - 1.0) / (5 - 1))
    assert (got["tokens"], got["chunks"]) == (5, 3)


def test_first_chunk_extra_tokens_are_zero_gaps_and_empty_chunks_do_not_count() -> None:
    got = overhead._timing(0.0, [(1.0, 2), (1.2, 0), (2.0, 1)])
    assert got["itl_s"] == [0.0, 1.0]
    assert got["chunk_gaps_s"] == [1.0]
    assert got["tpot_s"] == pytest.approx(0.5)
    assert got["chunks"] == 2


def test_one_token_has_no_tpot() -> None:
    got = overhead._timing(0.0, [(1.0, 1)])
    assert got["itl_s"] == [] and got["tpot_s"] is None


def test_summary_percentiles_and_tokens_per_chunk() -> None:
    rows = [overhead._timing(0.0, [(0.1, 1), (0.2, 1), (0.3, 2)]), overhead._timing(0.0, [(0.2, 1), (0.4, 1)])]
    s = overhead._summary(rows, wall_s=1.0)
    assert s["request_count"] == 2
    assert s["tokens_per_chunk"] == pytest.approx(6 / 5)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)  # gaps 100, 100, 0, 200 ms
    assert s["tpot_ms"]["p50"] == pytest.approx((200 / 3 + 200) / 2)
    assert s["output_tokens_per_s"] == 6.0


def _side(ttft: float, itl: float, tpot: float) -> dict[str, Any]:
    p = {"p50": 0.0, "p99": 0.0}
    return {
        "request_count": 4,
        "ttft_ms": {"p50": ttft, "p99": ttft * 1.5},
        "itl_ms": {"p50": itl, "p99": itl * 3},
        "tpot_ms": {"p50": tpot, "p99": tpot * 1.2},
        "itl_chunk_ms": p,
        "tokens_per_chunk": 1.0,
        "output_tokens_per_s": 60.0,
    }


def _repeat(stack_ttft: float, stack_tpot: float) -> dict[str, Any]:
    results = {
        "engine": {"concurrency_1": _side(300.0, 6.0, 6.0), "concurrency_4": _side(800.0, 10.0, 10.0)},
        "stack": {"concurrency_1": _side(stack_ttft, 7.0, stack_tpot), "concurrency_4": _side(800.0, 7.0, 14.0)},
    }
    return {"results": results, "check_values": overhead.check_values(results)}


def test_checks_and_markdown() -> None:
    reps = [_repeat(310.0, 7.0), _repeat(340.0, 9.0), _repeat(320.0, 7.5)]
    values = [r["check_values"] for r in reps]
    checks = {k: router.budget_check([v[k] for v in values], b) for k, b in overhead.BUDGETS.items()}
    assert checks["ttft_p50_c1_over_engine_ms"]["median"] == 20.0 and checks["ttft_p50_c1_over_engine_ms"]["met"]
    assert checks["ttft_p50_c1_over_engine_ms"]["repeats_met"] == 2
    assert not checks["tpot_p50_ratio_c4"]["met"]  # 14 / 10 = 1.4 > 1.3: reported as a miss
    out = {
        "workload": {"model": "tiny", "prompt_tokens": 1024, "output_tokens": 32, "batches_per_level": 4},
        **aggregate(reps),
        "repeats": reps,
        "repeat_count": 3,
        "checks": checks,
    }
    md = overhead.markdown(out)
    assert "3 repeats of 4 batches" in md
    assert "| stack | 1 | 320.0 (310.0-340.0) | 480.0 (465.0-510.0) | 7.00 | 21.00 | 7.50 (7.00-9.00) |" in md
    assert "| stack TPOT p50 / engine's, concurrency 4 | <= 1.30 | 1.40 | **missed** | 0 of 3 |" in md
    assert "| stack TTFT p50 - engine's, concurrency 1 (ms) | <= 25.00 | 20.00 (10.00-40.00) | met | 2 of 3 |" in md


def test_cli_help_names_repeats_and_the_rule() -> None:
    got = CliRunner().invoke(cli, ["bench", "overhead", "--help"])
    assert got.exit_code == 0
    assert "--repeats" in got.output and "TPOT" in got.output


def test_a_result_from_before_repeats_renders_a_rerun_note() -> None:
    assert "predates repeats" in overhead.markdown({"workload": {}, "results": {}, "checks": {}})


def test_integrity_cost_times_the_keyed_work_and_sets_it_against_ttft() -> None:
    """``--integrity``: the keyed work on a real handoff of a short prompt (a few
    repetitions: the path, not a measurement), the share of each repeat's TTFT, and the
    line the table gets; a result without it renders as before."""
    from bench import integrity_cost
    from tests.unit.engine_helpers import make_engine

    engine = make_engine(role="prefill", instance="bench-integrity")
    try:
        cost = integrity_cost.measure(engine, 64, reps=5)
        assert not engine.has_work() and engine.handoff_stats().outstanding == 0  # the offer was withdrawn
    finally:
        engine.close()
    assert cost["handoff_bytes"] > 0
    assert cost["per_handoff_us"] == cost["handoff_tag_us"] + cost["handoff_check_us"] > 0
    assert cost["frame_keyed_us"] > 0 and cost["store_tag_us_per_checkpoint"] > 0
    fixed = {**cost, "per_handoff_us": 200.0}
    reps = [_repeat(ttft, 7.0) for ttft in (2.0, 8.0, 4.0)]  # ms: shares 0.1, 0.025, 0.05
    got = integrity_cost.shares(fixed, reps)
    assert got["share_of_ttft_c1"] == pytest.approx(0.05) and got["met"] and got["target"] == 0.05
    out = {"workload": {}, "results": {}, "checks": {}, "integrity": got}
    (line,) = [ln for ln in integrity_cost.markdown(out) if ln]
    assert "per handoff 200.0 us" in line and "0.0500 of the stack's TTFT p50" in line and "met" in line
    assert integrity_cost.markdown({"workload": {}}) == []
    help_text = CliRunner().invoke(cli, ["bench", "overhead", "--help"]).output
    assert "--no-integrity" in help_text
