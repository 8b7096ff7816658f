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


def _scaled_copy(src: Path, dst: Path, factor: float) -> None:
    """The committed runs, with every "after" repeat's speedup multiplied by ``factor``."""
    dst.mkdir()
    for f in src.glob("*.json"):
        data = json.loads(f.read_text())
        if f.stem.split("_")[0] in eagle_ab.SIDES["after"]:
            for rep in data["repeats"]:
                for row in rep["decode"].values():
                    row["eagle_speedup_vs_decode"] *= factor
        (dst / f.name).write_text(json.dumps(data))


def test_the_committed_runs_hold_and_a_four_percent_lower_after_fails(tmp_path: Path) -> None:
    assert any(eagle_ab.RUNS_DIR.glob("*.json")), "the A/B runs are committed in %s" % eagle_ab.RUNS_DIR
    out = eagle_ab.summarize()
    assert out["checks"]["batch_1_not_lower"] and out["checks"]["batch_8_not_lower"]
    assert set(out["commits"]["before"]).isdisjoint(out["commits"]["after"])
    _scaled_copy(eagle_ab.RUNS_DIR, tmp_path / "runs", 0.97)
    slower = eagle_ab.summarize(tmp_path / "runs")
    assert slower["batches"]["batch_1"]["median_change"] < -0.035
    assert not slower["checks"]["batch_1_not_lower"], slower["batches"]["batch_1"]


def test_summary_refuses_an_empty_side_and_mixed_before_commits(tmp_path: Path) -> None:
    olds = sorted(eagle_ab.RUNS_DIR.glob("old_*.json"))
    assert olds, "the A/B runs are committed in %s" % eagle_ab.RUNS_DIR
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="before"):
        eagle_ab.summarize(tmp_path / "runs")
    shutil.copy(olds[0], tmp_path / "runs" / olds[0].name)
    with pytest.raises(FileNotFoundError, match="after"):
        eagle_ab.summarize(tmp_path / "runs")
    other = json.loads(olds[0].read_text())
    other["repeats"][0]["provenance"]["commit"] = "f" * 40
    (tmp_path / "runs" / "before_99.json").write_text(json.dumps(other))
    shutil.copy(sorted(eagle_ab.RUNS_DIR.glob("new_*.json"))[0], tmp_path / "runs" / "new_1.json")
    with pytest.raises(ValueError, match="several commits"):
        eagle_ab.summarize(tmp_path / "runs")
