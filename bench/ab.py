"""The serving path's cost before and after a change, in one sitting: an interleaved
A/B of ``bench overhead`` and ``bench router`` between a commit and this tree.

    hybridpd bench ab --before REV [--runs 2] [--repeats 2]   # run, then summarize
    hybridpd bench ab                                           # summarize the runs kept

Each side runs its own code: ``before`` from a temporary ``git worktree`` of the
commit (its code first on ``PYTHONPATH`` and as the working directory, so the
stack it starts and the Ray actors run that commit; this tree's built C
extensions copied where their source is the same), ``after`` from this tree.
The benches run in ABBA order, ``--runs`` times per side (each a whole bench
with its ``--repeats`` and its provenance, kept as
``<runs-dir>/<bench>_<side>_<i>.json``), so load that drifts over the sitting
falls on both sides alike.

Per metric (lower is better: the stack's TTFT, ITL and TPOT p50 at concurrency 1
and 4, its TTFT over the engine's and ITL / TPOT ratios to the engine's from the
same run; the router decision's p50 at 16K and 164K tokens), the repeats of every
run are pooled per side:

* ``median_change``: after's median / before's - 1;
* ``p_higher``: a one-sided permutation test (seeded; whole runs relabelled) of
  "after's median is above before's";
* ``within_5pct``: after's median is at most 1.05 x before's (``checks``; each
  reads "not comparable" unless every run, of both commits, ran on one machine).

The summary: ``bench/results/ab.json`` (``markdown`` renders its table).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import provenance
from bench.report import write_json

RESULTS = Path(__file__).resolve().parent / "results"
RUNS_DIR = RESULTS / "ab"
SUMMARY = RESULTS / "ab.json"
REPO = Path(__file__).resolve().parent.parent
BUDGET = 1.05
PERMUTATIONS = 20_000


def _overhead_metrics(rep: dict[str, Any]) -> dict[str, float]:
    res, checks = rep["results"]["stack"], rep["check_values"]
    out = {}
    for c in (1, 4):
        level = res["concurrency_%d" % c]
        for m in ("ttft_ms", "itl_ms", "tpot_ms"):
            out["stack_%s_p50_c%d" % (m[:-3], c)] = float(level[m]["p50"])
    out["stack_ttft_p50_c1_over_engine_ms"] = float(checks["ttft_p50_c1_over_engine_ms"])
    for key in ("itl_p50_ratio_c1", "tpot_p50_ratio_c1", "itl_p50_ratio_c4", "tpot_p50_ratio_c4"):
        out["stack_" + key] = float(checks[key])
    return out


def _router_metrics(rep: dict[str, Any]) -> dict[str, float]:
    return {"decision_p50_ms_" + size: float(row["p50_ms"]) for size, row in rep["results"].items()}


#: bench -> (its CLI arguments, the per-repeat metrics it yields)
BENCHES: dict[str, tuple[list[str], Callable[[dict[str, Any]], dict[str, float]]]] = {
    "overhead": (["overhead", "--quick"], _overhead_metrics),
    "router": (["router", "--iterations", "200"], _router_metrics),
}


def _bench(name: str, repo: Path, out: Path, repeats: int) -> None:
    """One whole bench from ``repo``'s code, written to ``out``."""
    args, _ = BENCHES[name]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, "-c", "from launch.cli import main; main()", "bench", *args]
    cmd += ["--repeats", str(repeats), "--json", str(out)]
    subprocess.run(cmd, cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)


def _copy_built_extensions(worktree: Path) -> None:
    for so in (REPO / "hybridpd").glob("*.so"):
        src = so.name.split(".")[0] + ".c"
        theirs = worktree / "hybridpd" / src
        if theirs.exists() and theirs.read_bytes() == (REPO / "hybridpd" / src).read_bytes():
            shutil.copy2(so, worktree / "hybridpd" / so.name)
        else:
            print("ab: %s differs at the older commit: its side runs without %s" % (src, so.name))


@contextlib.contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """A temporary ``git worktree`` of ``commit`` with this tree's built C extensions where
    their source is the same (they are built in place and git-ignored: without them that
    side would run the pure-Python fallbacks, a difference that is not the change under test)."""
    subprocess.run(["git", "worktree", "prune"], cwd=REPO, check=False)  # one a killed run left
    with tempfile.TemporaryDirectory(prefix="ab-") as tmp:
        wt = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(wt), commit], cwd=REPO, check=True)
        try:
            _copy_built_extensions(wt)
            yield wt
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=REPO, check=False)


def run(before: str, runs: int, repeats: int, benches: list[str], runs_dir: Path = RUNS_DIR) -> None:
    """``runs`` pairs of each bench, ``before`` (a commit) and this tree, in ABBA order."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    first = 1 + max((int(p.stem.rsplit("_", 1)[1]) for p in runs_dir.glob("*_*_*.json")), default=0)
    with worktree(before) as wt:
        for i in range(first, first + runs):
            order = [("before", wt), ("after", REPO)]
            for side, repo in order if (i - first) % 2 == 0 else order[::-1]:
                for name in benches:
                    print("ab: run %d/%d, %s, %s" % (i - first + 1, runs, name, side), flush=True)
                    _bench(name, repo, runs_dir / ("%s_%s_%d.json" % (name, side, i)), repeats)


def pooled_median(runs: list[list[float]]) -> float:
    return statistics.median(x for r in runs for x in r)


def p_higher(before: list[list[float]], after: list[list[float]], seed: int = 0) -> float:
    """One-sided permutation p-value of "after's pooled median is above before's" (whole
    runs relabelled: a run's repeats share its load). (k + 1) / (n + 1)."""
    observed = pooled_median(after) - pooled_median(before)
    pooled = before + after
    rng = random.Random(seed)
    at_least = 0
    for _ in range(PERMUTATIONS):
        rng.shuffle(pooled)
        if pooled_median(pooled[len(before) :]) - pooled_median(pooled[: len(before)]) >= observed:
            at_least += 1
    return (at_least + 1) / (PERMUTATIONS + 1)


def compare(before: list[list[float]], after: list[list[float]]) -> dict[str, Any]:
    mb, ma = pooled_median(before), pooled_median(after)
    fb, fa = [x for r in before for x in r], [x for r in after for x in r]
    return {
        "before": {"median": mb, "min": min(fb), "max": max(fb), "n": len(fb), "runs": len(before), "values": fb},
        "after": {"median": ma, "min": min(fa), "max": max(fa), "n": len(fa), "runs": len(after), "values": fa},
        "median_change": ma / mb - 1.0 if mb else 0.0,
        "p_higher": p_higher(before, after),
        "within_5pct": ma <= BUDGET * mb,
    }


def summarize(runs_dir: Path = RUNS_DIR) -> dict[str, Any]:
    """Per bench and metric, both sides' pooled repeats compared (module docstring)."""
    out: dict[str, Any] = {"benches": {}, "commits": {}, "provenance": [], "checks": {}}
    for name, (_, metrics) in BENCHES.items():
        sides: dict[str, dict[str, list[list[float]]]] = {}
        for side in ("before", "after"):
            for f in sorted(runs_dir.glob("%s_%s_*.json" % (name, side))):
                per: dict[str, list[float]] = {}
                for rep in json.loads(f.read_text())["repeats"]:
                    out["provenance"].append({"bench": name, "side": side, "file": f.name, **rep["provenance"]})
                    for k, v in metrics(rep).items():
                        per.setdefault(k, []).append(v)
                for k, vals in per.items():
                    sides.setdefault(side, {}).setdefault(k, []).append(vals)
        if set(sides) != {"before", "after"}:
            continue
        rows = {k: compare(sides["before"][k], sides["after"][k]) for k in sides["before"] if k in sides["after"]}
        out["benches"][name] = rows
        out["checks"].update({"%s_%s_within_5pct" % (name, k): r["within_5pct"] for k, r in rows.items()})
    for side in ("before", "after"):
        out["commits"][side] = sorted({p["commit"] for p in out["provenance"] if p["side"] == side})
    # the two commits are compared by design, but only on one machine
    out["same_machine"] = provenance.same_machine(out["provenance"])
    out["checks"] = provenance.judged(out["same_machine"], out["checks"])
    if not out["benches"]:
        raise FileNotFoundError("no paired runs in %s (run with --before first)" % runs_dir)
    return out


def markdown(out: dict[str, Any]) -> str:
    rows = [
        "| bench | metric | before: median (min-max, repeats) | after | change | p (after higher) | within 5% |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(s: dict[str, Any]) -> str:
        return "%.3f (%.3f-%.3f, %d)" % (s["median"], s["min"], s["max"], s["n"])

    def verdict(within: bool) -> str:  # two machines' runs are no verdict
        return ("yes" if within else "no") if out.get("same_machine", True) else provenance.NOT_COMPARABLE

    for name, metrics in out["benches"].items():
        for k, c in metrics.items():
            rows.append(
                "| %s | %s | %s | %s | %+.1f%% | %.2f | %s |"
                % (
                    name,
                    k,
                    cell(c["before"]),
                    cell(c["after"]),
                    100 * c["median_change"],
                    c["p_higher"],
                    ("yes" if c["within_5pct"] else "no")
                    if out.get("same_machine", True)
                    else provenance.NOT_COMPARABLE,
                )
            )
    commits = "before %s, after %s" % (
        ", ".join(c[:7] for c in out["commits"]["before"]),
        ", ".join(c[:7] for c in out["commits"]["after"]),
    )
    return "Commits: %s.\n\n%s\n" % (commits, "\n".join(rows))


def main(before: str | None, runs: int, repeats: int, benches: list[str], json_path: Path) -> dict[str, Any]:
    """Runs go to the folder named after ``json_path`` (``ab.json``: ``ab/``), so each
    comparison keeps its own runs."""
    runs_dir = (json_path.parent / json_path.stem).resolve()  # the benches run in other folders
    if before:
        run(before, runs, repeats, benches, runs_dir)
    out = summarize(runs_dir)
    write_json(json_path, out)
    return out
