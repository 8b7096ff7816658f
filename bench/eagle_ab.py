"""EAGLE's decode speedup before and after a change: an interleaved A/B of ``bench eagle``.

    hybridpd bench eagle-ab --before REV [--runs 8]   # run, then summarize
    hybridpd bench eagle-ab                            # summarize the committed runs

A single ``bench eagle`` run cannot say whether a change made the speedup lower:
on a shared 2-core machine one repeat's paired ratio (EAGLE tokens/s over plain
tokens/s, timed back to back) varies more than the changes it should detect. So
the two commits run
in turn, in ABBA order, ``--runs`` times each, every run a whole ``bench
eagle`` (its own repeats and provenance) written as ``<runs-dir>/before_<i>.json``
/ ``after_<i>.json``: load that drifts over the sitting falls on both sides
alike. ``before`` runs from a temporary ``git worktree`` of that commit with
this environment (its code on ``PYTHONPATH``, this tree's built C extensions
copied where their source is the same), so each side's provenance names its
own commit. One folder holds one comparison: its before runs are one commit;
its after runs may span commits of the same code line (each is listed).

The summary (``bench/results/eagle_ab.json``) pools every repeat of every run
per side (``old_*`` / ``new_*``, the names of the committed runs, count as
before / after) and, per batch size, gives each side's median ratio with
min-max and count, and:

* ``median_change``: median after / median before - 1;
* ``p_lower``: a one-sided permutation test (seeded) of "after's median is
  below before's": the share of 20,000 random relabellings of whole runs (a
  run's repeats share its load: the runs are the independent samples) whose
  pooled-median difference is at least as far below as the observed one;
* ``checks.batch_<b>_not_lower``: after's pooled median is at least before's,
  or the decrease is not distinguishable from the spread (``p_lower`` >= 0.05).
  It fails on a real decrease: ``tests/unit/test_eagle_ab.py`` scales the
  committed after repeats by 0.97 (a median 4% below before's at batch 1) and
  expects the check to fail.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.ab import pooled_median, worktree
from bench.report import write_json

RESULTS = Path(__file__).resolve().parent / "results"
RUNS_DIR = RESULTS / "eagle_ab"
SUMMARY = RESULTS / "eagle_ab.json"
REPO = Path(__file__).resolve().parent.parent
#: file stems of each side (``old``/``new``: the first sitting's names)
SIDES = {"before": ("before", "old"), "after": ("after", "new")}
P_THRESHOLD = 0.05
PERMUTATIONS = 20_000


def _bench_engine(repo: Path, out: Path, repeats: int) -> None:
    """One whole ``bench eagle`` from ``repo``'s code, written to ``out``."""
    code = "import sys; from bench.engine import main; main(sys.argv[1:])"
    env = {**os.environ, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, "-c", code, "--repeats", str(repeats), "--json", str(out)]
    subprocess.run(cmd, cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)


def run(before: str, runs: int, repeats: int, runs_dir: Path = RUNS_DIR) -> None:
    """``runs`` pairs of ``bench eagle`` runs, ``before`` (a commit) and this tree, in
    ABBA order (drift over the sitting does not favour a side)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    first = 1 + max((int(p.stem.split("_")[1]) for p in runs_dir.glob("*_*.json")), default=0)
    with worktree(before) as wt:
        for i in range(first, first + runs):
            order = [("before", wt), ("after", REPO)]
            for side, repo in order if (i - first) % 2 == 0 else order[::-1]:
                print("eagle-ab: run %d/%d, %s" % (i - first + 1, runs, side), flush=True)
                _bench_engine(repo, runs_dir / ("%s_%d.json" % (side, i)), repeats)


def _runs(files: list[Path]) -> tuple[dict[str, list[list[float]]], list[dict[str, Any]]]:
    """Per batch size, each run's paired speedups (one per repeat); every repeat's provenance."""
    runs: dict[str, list[list[float]]] = {}
    records: list[dict[str, Any]] = []
    for f in files:
        this: dict[str, list[float]] = {}
        for rep in json.loads(f.read_text())["repeats"]:
            records.append(rep["provenance"])
            for batch, row in rep["decode"].items():
                this.setdefault(batch, []).append(float(row["eagle_speedup_vs_decode"]))
        for batch, ratios in this.items():
            runs.setdefault(batch, []).append(ratios)
    return runs, records


def p_lower(
    before: list[list[float]], after: list[list[float]], permutations: int = PERMUTATIONS, seed: int = 0
) -> float:
    """One-sided permutation p-value of "after's pooled median is below before's".
    Whole runs are relabelled, not repeats: a run's repeats share its load, so the
    runs are the independent samples. (k + 1) / (n + 1): the observed labelling counts."""
    observed = pooled_median(after) - pooled_median(before)
    pooled = before + after
    rng = random.Random(seed)
    at_least = 0
    for _ in range(permutations):
        rng.shuffle(pooled)
        if pooled_median(pooled[len(before) :]) - pooled_median(pooled[: len(before)]) <= observed:
            at_least += 1
    return (at_least + 1) / (permutations + 1)


def compare(before: list[list[float]], after: list[list[float]]) -> dict[str, Any]:
    """Both sides' pooled medians (``before``/``after``: each run's repeats), the change
    and whether it is "not lower" (module docstring)."""
    mb, ma = pooled_median(before), pooled_median(after)
    flat_b, flat_a = [x for r in before for x in r], [x for r in after for x in r]
    p = p_lower(before, after)
    return {
        "before": {"median": mb, "min": min(flat_b), "max": max(flat_b), "n": len(flat_b), "runs": len(before)},
        "after": {"median": ma, "min": min(flat_a), "max": max(flat_a), "n": len(flat_a), "runs": len(after)},
        "median_change": ma / mb - 1.0,
        "p_lower": p,
        "not_lower": ma >= mb or p >= P_THRESHOLD,
    }


def summarize(runs_dir: Path = RUNS_DIR) -> dict[str, Any]:
    """The summary of every run in ``runs_dir`` (module docstring). The before side must
    be one commit; the after side may pool several (each listed in ``commits``)."""
    sides = {}
    for side, stems in SIDES.items():
        files = sorted(f for stem in stems for f in runs_dir.glob("%s_*.json" % stem))
        if not files:
            raise FileNotFoundError("no %s runs in %s (run with --before first)" % (side, runs_dir))
        sides[side] = (files, *_runs(files))
    before_commits = {r["commit"] for r in sides["before"][2]}
    if len(before_commits) != 1:
        raise ValueError(
            "%s: before runs from several commits %s: one comparison per folder (--runs-dir)"
            % (runs_dir, sorted(c[:7] for c in before_commits))
        )
    batches = [b for b in sides["before"][1] if b in sides["after"][1]]
    out: dict[str, Any] = {
        "runs": {side: [f.name for f in files] for side, (files, _, _) in sides.items()},
        "commits": {side: sorted({r["commit"] for r in recs}) for side, (_, _, recs) in sides.items()},
        "batches": {b: compare(sides["before"][1][b], sides["after"][1][b]) for b in batches},
        "provenance": [r for _, _, recs in sides.values() for r in recs],
    }
    out["repeat_count"] = min(len(recs) for _, _, recs in sides.values())  # per side
    out["checks"] = {"%s_not_lower" % b: out["batches"][b]["not_lower"] for b in batches}
    out["checks"]["p_threshold"] = P_THRESHOLD
    return out


def markdown(out: dict[str, Any]) -> str:
    rows = [
        "| | before: speedup (min-max, repeats) | after | change of the median | p (after lower) |",
        "|---|---|---|---|---|",
    ]
    for b, c in out["batches"].items():
        cell = lambda s: "x%.2f (%.2f-%.2f, %d)" % (s["median"], s["min"], s["max"], s["n"])  # noqa: E731
        rows.append(
            "| %s | %s | %s | %+.1f%% | %.2f |"
            % (b.replace("_", " "), cell(c["before"]), cell(c["after"]), 100 * c["median_change"], c["p_lower"])
        )
    commits = "before %s, after %s" % (
        ", ".join(c[:7] for c in out["commits"]["before"]),
        ", ".join(c[:7] for c in out["commits"]["after"]),
    )
    return "Commits: %s.\n\n%s\n" % (commits, "\n".join(rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="the commit to compare against (runs the A/B first)")
    ap.add_argument("--runs", type=int, default=8, help="interleaved bench eagle runs per side")
    ap.add_argument("--repeats", type=int, default=3, help="repeats inside each run")
    ap.add_argument("--runs-dir", type=Path, default=RUNS_DIR, help="where the runs are (one comparison each)")
    ap.add_argument("--json", type=Path, default=SUMMARY)
    args = ap.parse_args(argv)
    if args.before:
        run(args.before, args.runs, args.repeats, args.runs_dir)
    out = summarize(args.runs_dir)
    write_json(args.json, out)
    print(markdown(out), end="")


if __name__ == "__main__":
    main()
