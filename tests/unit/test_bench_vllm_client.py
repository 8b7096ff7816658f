"""bench/vllm_client.py's budgets: our 1+1 P/D against vLLM's own, judged on the medians."""

from __future__ import annotations

import json
from pathlib import Path

from bench import tables
from bench.provenance import NOT_COMPARABLE
from bench.vllm_client import PD_BUDGETS, WORKLOADS, pd_checks, stage_means

MACHINE = {"cpu": "Xeon", "cpu_flags": ["avx2", "avx512f"], "machine_id": "m-1", "cpus": 2}


def _rec(started: float, machine_id: str = "m-1") -> dict:
    return {
        "commit": "c0",
        "dirty": False,
        "started": started,
        "ended": started + 10.0,
        "machine": {**MACHINE, "machine_id": machine_id},
    }


def _target(ttft: float, itl: float, started: float = 0.0, machine_id: str = "m-1") -> dict:
    out: dict = {name: {"median_ttft_ms": ttft, "median_itl_ms": itl} for name in WORKLOADS}
    out["provenance"] = [_rec(started, machine_id)]
    return out


def test_pd_checks_judge_the_medians_against_the_budgets() -> None:
    got = pd_checks({"stack-vllm-1p1d": _target(115.0, 11.5), "vllm-pd": _target(100.0, 10.0, 20.0)}, list(WORKLOADS))
    assert got["budgets"] == PD_BUDGETS
    assert got["random_c1_ttft_p50_vs_vllm_pd"] == 1.15 and got["random_c1_ttft_p50_vs_vllm_pd_ok"]
    assert got["random_c4_itl_p50_vs_vllm_pd"] == 1.15 and not got["random_c4_itl_p50_vs_vllm_pd_ok"]
    assert not any(k.startswith("prefix_repetition") for k in got)  # no budget there
    # a target that did not run, or a missing number, is no verdict
    assert pd_checks({"vllm-pd": _target(1.0, 1.0)}, list(WORKLOADS)) == {}
    none = pd_checks({"stack-vllm-1p1d": _target(0.0, 1.0), "vllm-pd": _target(1.0, 1.0, 20.0)}, list(WORKLOADS))
    assert none["random_c1_ttft_p50_vs_vllm_pd"] is None and none["random_c1_ttft_p50_vs_vllm_pd_ok"] is False


def test_pd_checks_judge_vllms_shipped_nixl_settings_too_and_only_within_one_run() -> None:
    variants = {
        "stack-vllm-1p1d": _target(100.0, 10.0),
        "vllm-pd": _target(100.0, 10.0, 20.0),
        "vllm-pd-shipped": _target(200.0, 20.0, 40.0, machine_id="m-2"),  # another machine
    }
    got = pd_checks(variants, list(WORKLOADS))
    assert got["random_c1_ttft_p50_vs_vllm_pd"] == 1.0
    assert got["random_c1_ttft_p50_vs_vllm_pd_shipped"] == NOT_COMPARABLE
    variants["vllm-pd-shipped"] = _target(200.0, 20.0, 40.0)
    got = pd_checks(variants, list(WORKLOADS))
    assert got["random_c1_ttft_p50_vs_vllm_pd_shipped"] == 0.5 and got["random_c4_itl_p50_vs_vllm_pd_shipped_ok"]


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


def test_the_vllm_baselines_get_our_vllm_engines_kv_budget() -> None:
    """#52: vllm-direct and vllm-pd run on the KV space our vLLM engine gets by default."""
    import importlib
    import re

    package = Path(__file__).resolve().parents[2] / "hybridpd" / "engine" / "vllm"
    defining = [p for p in package.glob("*.py") if re.search(r"^DEFAULT_KV_CACHE_BYTES\b", p.read_text(), re.M)]
    assert len(defining) == 1, defining
    module = importlib.import_module("hybridpd.engine.vllm." + defining[0].stem)
    from bench.vllm_direct import KV_CACHE_GIB

    assert module.DEFAULT_KV_CACHE_BYTES == KV_CACHE_GIB << 30
