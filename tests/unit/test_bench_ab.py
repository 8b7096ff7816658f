"""bench/ab.py: the A/B summary pools each side's repeats per metric and fails
the 5% budget on a real increase (synthetic runs, no stack)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import ab
from bench.provenance import NOT_COMPARABLE

pytestmark = pytest.mark.unit


def _overhead(scale: float) -> dict:
    level = {m: {"p50": 10.0 * scale} for m in ("ttft_ms", "itl_ms", "tpot_ms")}
    checks = {
        "ttft_p50_c1_over_engine_ms": 5.0 * scale,
        **{k: 1.1 * scale for k in ("itl_p50_ratio_c1", "tpot_p50_ratio_c1", "itl_p50_ratio_c4", "tpot_p50_ratio_c4")},
    }
    return {"results": {"stack": {"concurrency_1": level, "concurrency_4": level}}, "check_values": checks}


MACHINE = {"cpu": "Xeon", "cpu_flags": ["avx2", "avx512f"], "machine_id": "m-1", "cpus": 2}


def _write(d: Path, side: str, i: int, scale: float, commit: str, machine_id: str = "m-1") -> None:
    reps = []
    for j in range(2):
        rep = _overhead(scale * (1 + 0.001 * j))
        rep["provenance"] = {"commit": commit, "machine": {**MACHINE, "machine_id": machine_id}}
        reps.append(rep)
    (d / ("overhead_%s_%d.json" % (side, i))).write_text(json.dumps({"repeats": reps}))


def test_equal_sides_are_within_and_a_ten_percent_rise_is_not(tmp_path: Path) -> None:
    for i in range(1, 4):
        _write(tmp_path, "before", i, 1.0, "a" * 40)
        _write(tmp_path, "after", i, 1.0, "b" * 40)
    out = ab.summarize(tmp_path)
    assert out["commits"] == {"before": ["a" * 40], "after": ["b" * 40]}
    assert all(out["checks"].values()) and set(out["benches"]) == {"overhead"}
    row = out["benches"]["overhead"]["stack_ttft_p50_c1"]
    assert row["before"]["n"] == 6 and row["median_change"] == pytest.approx(0.0)
    for f in tmp_path.glob("overhead_after_*.json"):
        f.unlink()
    for i in range(1, 4):
        _write(tmp_path, "after", i, 1.10, "b" * 40)
    out = ab.summarize(tmp_path)
    row = out["benches"]["overhead"]["stack_ttft_p50_c1"]
    assert not row["within_5pct"] and row["median_change"] == pytest.approx(0.1, abs=0.01)
    assert row["p_higher"] < 0.1
    assert "overhead" in ab.markdown(out)


def test_runs_on_two_machines_are_no_verdict(tmp_path: Path) -> None:
    """The two commits are compared by design, on one machine only."""
    for i in range(1, 3):
        _write(tmp_path, "before", i, 1.0, "a" * 40)
        _write(tmp_path, "after", i, 1.0, "b" * 40, machine_id="m-2")
    out = ab.summarize(tmp_path)
    assert out["same_machine"] is False
    assert set(out["checks"].values()) == {NOT_COMPARABLE}
    assert "| %s |" % NOT_COMPARABLE in ab.markdown(out)


def test_no_runs_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ab.summarize(tmp_path)
