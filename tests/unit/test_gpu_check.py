"""The GPU check's measurement logic, run on the CPU so CI covers it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_check


def test_gpu_check_on_cpu_reports_hits_acceptance_and_equality(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    gpu_check.main(
        [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--streams",
            "2",
            "--start",
            "300",
            "--grow",
            "60",
            "--gen",
            "6",
            "--json",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert res["greedy_equal_to_reference"] and res["mismatched_requests"] == []
    assert res["hit_tokens_ideal"] == 288  # the last 16-boundary before token 300 (the native EAGLE head replays none)
    assert res["hit_tokens_min"] == res["hit_tokens_ideal"]
    assert res["eagle_mean_acceptance_length"] >= 1.0
    assert res["pools_free_after"]


def test_gpu_check_refuses_a_cuda_device_this_machine_lacks() -> None:
    # index 64 exists on no machine, with or without CUDA: the refusal is clean either way
    with pytest.raises(SystemExit, match="--device cuda:64: torch sees"):
        gpu_check.main(["--device", "cuda:64"])
    assert gpu_check.cuda_problem("cpu") is None
