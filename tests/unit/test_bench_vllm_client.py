"""bench/vllm_client.py's budgets: our 1+1 P/D against vLLM's own, judged on the medians."""

from __future__ import annotations

import json
from pathlib import Path

from bench import tables
from bench.vllm_client import PD_BUDGETS, WORKLOADS, pd_checks, stage_means


def _target(ttft: float, itl: float) -> dict:
    return {name: {"median_ttft_ms": ttft, "median_itl_ms": itl} for name in WORKLOADS}


def test_pd_checks_judge_the_medians_against_the_budgets() -> None:
    got = pd_checks({"stack-vllm-1p1d": _target(115.0, 11.5), "vllm-pd": _target(100.0, 10.0)}, list(WORKLOADS))
    assert got["budgets"] == PD_BUDGETS
    assert got["random_c1_ttft_p50_vs_vllm_pd"] == 1.15 and got["random_c1_ttft_p50_vs_vllm_pd_ok"]
    assert got["random_c4_itl_p50_vs_vllm_pd"] == 1.15 and not got["random_c4_itl_p50_vs_vllm_pd_ok"]
    assert not any(k.startswith("prefix_repetition") for k in got)  # no budget there
    # a target that did not run, or a missing number, is no verdict
    assert pd_checks({"vllm-pd": _target(1.0, 1.0)}, list(WORKLOADS)) == {}
    none = pd_checks({"stack-vllm-1p1d": _target(0.0, 1.0), "vllm-pd": _target(1.0, 1.0)}, list(WORKLOADS))
    assert none["random_c1_ttft_p50_vs_vllm_pd"] is None and none["random_c1_ttft_p50_vs_vllm_pd_ok"] is False


def test_the_block_shows_the_checks_once(tmp_path: Path) -> None:
    out = {
        "workloads": ["random_c1"],
        "variants": {"vllm-pd": {"random_c1": {"median_ttft_ms": 1.0, "median_itl_ms": 2.0}}},
        "checks": {"random_c1_ttft_p50_vs_vllm_pd_ok": False},
    }
    (tmp_path / "vllm_client_pd_quick.json").write_text(json.dumps(out))
    text = tables.render_block("vllm-client-pd-quick", tmp_path)
    assert "| vllm-pd | random_c1 |" in text
    # once; and a comparison whose variants are not one run (no provenance here) is no verdict
    assert text.count("`random_c1_ttft_p50_vs_vllm_pd_ok` not comparable") == 1


def test_ttft_stages_are_the_mean_of_the_requests_between_two_scrapes(tmp_path: Path) -> None:
    before = {"prefill": (1.0, 10.0), "decode": (0.5, 10.0)}
    after = {"prefill": (2.5, 20.0), "decode": (0.5, 10.0), "queue": (0.02, 10.0)}
    assert stage_means(before, after) == {"prefill": 150.0, "queue": 2.0}  # decode: no request in between
    out = {
        "workloads": ["random_c1"],
        "variants": {
            "stack-vllm-1p1d": {
                "random_c1": {"median_ttft_ms": 1.0, "ttft_stage_mean_ms": {"queue": 1.25, "decode": 30.0}}
            },
            "vllm-pd": {"random_c1": {"median_ttft_ms": 1.0}},
        },
        "checks": {},
    }
    (tmp_path / "vllm_client_pd_quick.json").write_text(json.dumps(out))
    text = tables.render_block("vllm-client-pd-quick", tmp_path)
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| stack-vllm-1p1d"].endswith("| 1.2 / - / - / 30.0 |")
    assert rows["| vllm-pd"].endswith("| - |")  # no router there
