"""The placement replay (``bench/placement.py``): pure and deterministic, so its
verdicts are asserted exactly; the checks it publishes can fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import placement
from bench.placement import Replay, checks, replay, workloads

pytestmark = pytest.mark.unit


def test_a_pair_sharing_a_document_hits_only_with_placement() -> None:
    doc = tuple(range(100, 1100))
    prompts = [doc + tuple(range(3000, 3041)), doc + tuple(range(4000, 4043))]
    r = Replay()
    off = replay(prompts, [False, True], "tail+junction", r)
    value = replay(prompts, [False, True], "value", r)
    # off: the second leaves the junction (992) for a third; it restores nothing itself
    assert off["hit_tokens"] == 0 and off["ideal_tokens"] == 992 and off["states"] == 3
    assert value["ideal_tokens"] == 992 and 0.75 * 992 <= value["hit_tokens"] <= 992
    assert value["states"] == off["states"] + 2  # one placed per prefill: a second would not pay


def test_workloads_and_the_report(tmp_path: Path) -> None:
    w = workloads(Replay())
    assert list(w) == ["fanout", "tree", "twosharer", "growing"]
    prompts, counted = w["twosharer"]
    assert counted == [False, True] * (len(prompts) // 2)
    out = placement.run(tmp_path / "placement.json")
    saved = json.loads((tmp_path / "placement.json").read_text())
    assert saved["checks"] == out["checks"] and (tmp_path / "placement.png").exists()
    for name, row in saved["workloads"].items():
        # placement never costs hits; the threshold writes fewer states than always the cap, at
        # most one placed per prefill's worth here, and costs little of its hits
        assert row["value"]["hit_ratio"] >= row["tail+junction"]["hit_ratio"], name
        assert row["value"]["states"] <= 2 * row["tail+junction"]["states"], name
        assert row["value"]["states"] < row["value_no_min_gain"]["states"], name
        assert row["value"]["hit_ratio"] >= row["value_no_min_gain"]["hit_ratio"] - 0.01, name
    assert saved["workloads"]["twosharer"]["value"]["hit_ratio"] >= 0.75


def test_checks_compare_with_the_best_interval() -> None:
    def row(ours: float, theirs: float | None):  # type: ignore[no-untyped-def]
        return {"value": {"hit_ratio": ours}, "best_interval": None if theirs is None else {"hit_ratio": theirs}}

    got = checks({"a": row(0.9, 0.8), "b": row(0.5, 0.5), "c": row(0.7, None)})
    assert got["value_not_below_best_interval"] and got["value_above_best_interval_on"] == ["a", "c"]
    got = checks({"a": row(0.9, 0.95), "b": row(0.9, 0.8)})
    assert not got["value_not_below_best_interval"] and got["value_below_best_interval_on"] == ["a"]
    assert not got["value_above_best_interval_on_two"]


def test_shared_prefix_embeds_the_report() -> None:
    from bench import shared_prefix_run

    rep = placement.report()
    assert set(rep) == {"replay", "state_bytes_each", "workloads", "checks"}
    out = {"variants": {}, "placement": rep}
    text = shared_prefix_run.markdown(out)
    assert "Placement replay" in text and "| twosharer | value |" in text
