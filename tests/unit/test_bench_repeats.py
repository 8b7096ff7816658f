"""bench/repeats.py and bench/provenance.py: every repeat kept, medians published,
provenance recorded and "same run" computed from it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import provenance
from bench.repeats import aggregate, measure, measure_variants, repeat_views, summary
from bench.report import spread


def test_summary_is_the_median_with_every_repeat() -> None:
    assert summary([3.0, 1.0, 10.0]) == {"median": 3.0, "min": 1.0, "max": 10.0, "repeats": [3.0, 1.0, 10.0]}
    assert summary([1, 2, 3, 4])["median"] == 2.5  # never a pick: the midpoint of an even count


def test_aggregate_leaves() -> None:
    reps = [
        {"ttft": 10.0, "ok": True, "phases": {"a": {"hit": 1.0}}, "rounds": [1, 5], "name": "x", "requests": [1]},
        {"ttft": 30.0, "ok": False, "phases": {"a": {"hit": 1.0}}, "rounds": [3, 5], "name": "x", "requests": [2]},
        {"ttft": 20.0, "ok": True, "phases": {"a": {"hit": 1.0}}, "rounds": [2, 5], "name": "y", "requests": [3]},
    ]
    out = aggregate(reps)
    assert out["ttft"] == 20.0 and out["min"]["ttft"] == 10.0 and out["max"]["ttft"] == 30.0
    assert out["ok"] is False  # a flag holds only if it held in every repeat
    assert out["phases"] == {"a": {"hit": 1.0}} and out["rounds"] == [2.0, 5.0]
    assert "name" not in out and "requests" not in out  # differing values and per-request rows stay per repeat
    ints = aggregate([{"round": 2, "n": 3}, {"round": 2, "n": 4}])
    assert ints["round"] == 2 and isinstance(ints["round"], int) and ints["n"] == 3.5  # an int stays one
    rows = aggregate([{"r": [{"t": 1.0}, {"t": 4.0}]}, {"r": [{"t": 3.0}, {"t": 2.0}]}])
    assert rows["r"] == [{"t": 2.0}, {"t": 3.0}] and rows["max"]["r"] == [{"t": 3.0}, {"t": 4.0}]
    with pytest.raises(ValueError):
        aggregate([])


def test_measure_keeps_every_repeat_with_its_provenance() -> None:
    values = iter([5.0, 1.0, 3.0])
    out = measure(lambda: {"x": next(values)}, 3)
    assert out["x"] == 3.0 and out["min"]["x"] == 1.0 and out["max"]["x"] == 5.0
    assert [r["x"] for r in out["repeats"]] == [5.0, 1.0, 3.0] and out["repeat_count"] == 3
    provs = out["provenance"]
    assert len(provs) == 3 and all(p["ended"] >= p["started"] for p in provs)
    assert (
        provs[0]["commit"]
        == subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    assert {"python", "torch"} <= set(provs[0]["versions"]) and len(provs[0]["load_average_before"]) == 3
    with pytest.raises(ValueError):
        measure(lambda: {}, 0)


def test_measure_variants_interleaves_and_leaves_out_missing_environments() -> None:
    order: list[str] = []

    def make(name: str) -> Any:
        def fn() -> dict[str, Any]:
            order.append(name)
            if name == "c":
                raise FileNotFoundError("no vLLM environment")
            return {"v": float(len(order))}

        return fn

    out, notes = measure_variants({n: make(n) for n in "abc"}, 2)
    assert order == ["a", "b", "c", "a", "b"]  # A B C, A B: a missing one is not retried
    assert set(out) == {"a", "b"} and notes == {"c": "left out: no vLLM environment"}
    assert [r["v"] for r in out["a"]["repeats"]] == [1.0, 4.0] and out["a"]["v"] == 2.5
    views = repeat_views(out)
    assert [v["b"]["v"] for v in views] == [2.0, 5.0]
    # a variant with fewer repeats (an older merged run) is in the first views only: every
    # repeat of the others is still checked
    out["d"] = {"v": 9.0}
    views = repeat_views(out)
    assert [sorted(v) for v in views] == [["a", "b", "d"], ["a", "b"]]


def _rec(started: float, ended: float | None, commit: str = "c", dirty: bool = False) -> dict[str, Any]:
    machine = {"cpu": "Test CPU", "cpu_flags": ["avx2"], "machine_id": "m0"}
    return {"commit": commit, "dirty": dirty, "started": started, "ended": ended, "machine": machine}


def test_same_run_is_computed_from_times_and_commits() -> None:
    assert provenance.same_run([_rec(0, 100), _rec(110, 200), _rec(150, 180)])
    assert not provenance.same_run([_rec(0, 100), _rec(100 + provenance.SAME_RUN_MAX_GAP_S + 1, 500)])
    assert not provenance.same_run([_rec(0, 100), _rec(110, 200, commit="d")])
    assert not provenance.same_run([_rec(0, 100), _rec(110, 200, dirty=True)])
    assert not provenance.same_run([_rec(0, None)]) and not provenance.same_run([])


def test_git_state_marks_code_changes_dirty_and_ignores_results(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results" / "r.json").write_text("{}\n")
    git("add", ".")
    git("-c", "user.email=a@b", "-c", "user.name=n", "commit", "-qm", "init")
    commit, dirty = provenance.git_state(tmp_path)
    assert len(commit) == 40 and not dirty
    (tmp_path / "bench" / "results" / "r.json").write_text('{"new": 1}\n')
    (tmp_path / "NOTES.md").write_text("prose\n")
    assert provenance.git_state(tmp_path) == (commit, False)  # results and prose do not change what is measured
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance.git_state(tmp_path) == (commit, True)
    git("checkout", "code.py")
    (tmp_path / "new.py").write_text("y = 1\n")
    assert provenance.git_state(tmp_path) == (commit, True)
    assert provenance.git_state(tmp_path / "bench" / "results" / "nowhere") == ("", True)


def test_spread_shows_min_max_only_where_repeats_differ() -> None:
    v = {"t": 842.81, "p": {"h": 1.0}, "min": {"t": 800.1, "p": {"h": 1.0}}, "max": {"t": 901.3, "p": {"h": 1.0}}}
    assert spread(v, "t") == "842.8 (800.1-901.3)"
    assert spread(v, "p", "h", spec="%.3f") == "1.000"
    assert spread(v, "absent") == "-"
    assert spread({"r": [{"x": 2.0}], "min": {"r": [{"x": 1.0}]}, "max": {"r": [{"x": 3.0}]}}, "r", 0, "x") == (
        "2.0 (1.0-3.0)"
    )
