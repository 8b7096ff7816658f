"""bench/eagle_ab.py: the "EAGLE speedup not lower than before" check is
computed from the pooled repeats and fails on a real decrease."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import eagle_ab

pytestmark = pytest.mark.unit


def test_equal_sides_are_not_lower_and_a_shifted_side_is() -> None:
    before = [[1.8 + 0.01 * ((3 * r + i) % 20) for i in range(3)] for r in range(14)]
    shift = lambda d: [[x + d for x in run] for run in before]  # noqa: E731
    same = eagle_ab.compare(before, list(reversed(before)))
    assert same["median_change"] == 0.0 and same["not_lower"]
    lower = eagle_ab.compare(before, shift(-0.1))
    assert lower["p_lower"] < eagle_ab.P_THRESHOLD and not lower["not_lower"]
    higher = eagle_ab.compare(before, shift(0.1))
    assert higher["median_change"] > 0 and higher["not_lower"] and higher["p_lower"] > 0.9


def _write_runs(runs: Path, after_factor: float = 1.0, before_commit: str = "a" * 40) -> None:
    """Eight synthetic runs a side (``before_<i>``, ``after_<i>``), three repeats each:
    speedups around 1.9 (batch 1) and 1.4 (batch 8), the after side's times ``after_factor``."""
    runs.mkdir(exist_ok=True)
    for side, commit, factor in (("before", before_commit, 1.0), ("after", "b" * 40, after_factor)):
        for i in range(1, 9):
            reps = [
                {
                    "decode": {
                        "batch_1": {"eagle_speedup_vs_decode": factor * (1.9 + 0.01 * ((3 * i + j) % 7))},
                        "batch_8": {"eagle_speedup_vs_decode": factor * (1.4 + 0.01 * ((5 * i + j) % 7))},
                    },
                    "provenance": {"commit": commit},
                }
                for j in range(3)
            ]
            (runs / ("%s_%d.json" % (side, i))).write_text(json.dumps({"repeats": reps}))


def test_equal_runs_hold_and_a_four_percent_lower_after_fails(tmp_path: Path) -> None:
    _write_runs(tmp_path / "same")
    out = eagle_ab.summarize(tmp_path / "same")
    assert out["checks"]["batch_1_not_lower"] and out["checks"]["batch_8_not_lower"]
    assert set(out["commits"]["before"]).isdisjoint(out["commits"]["after"])
    _write_runs(tmp_path / "slower", after_factor=0.96)
    slower = eagle_ab.summarize(tmp_path / "slower")
    assert slower["batches"]["batch_1"]["median_change"] < -0.035
    assert not slower["checks"]["batch_1_not_lower"], slower["batches"]["batch_1"]


def test_summary_refuses_an_empty_side_and_mixed_before_commits(tmp_path: Path) -> None:
    _write_runs(tmp_path / "all")
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="before"):
        eagle_ab.summarize(tmp_path / "runs")
    shutil.copy(tmp_path / "all" / "before_1.json", tmp_path / "runs" / "old_1.json")
    with pytest.raises(FileNotFoundError, match="after"):
        eagle_ab.summarize(tmp_path / "runs")
    other = json.loads((tmp_path / "all" / "before_2.json").read_text())
    other["repeats"][0]["provenance"]["commit"] = "f" * 40
    (tmp_path / "runs" / "before_99.json").write_text(json.dumps(other))
    shutil.copy(tmp_path / "all" / "after_1.json", tmp_path / "runs" / "new_1.json")
    with pytest.raises(ValueError, match="several commits"):
        eagle_ab.summarize(tmp_path / "runs")
