"""Repeats, not picks: every repeat is kept and the published figure is the median.

``measure(fn, repeats)`` runs ``fn`` ``repeats`` times, each inside its own
provenance record, and returns the median of every numeric field with ``min``,
``max`` and every repeat beside it::

    {**median_fields, "min": {...}, "max": {...}, "repeats": [r1, r2, ...],
     "repeat_count": R, "provenance": [p1, p2, ...]}

The median fields sit at the top so code reading one run's fields reads the
median unchanged; budgets are judged on them. How leaves combine
(``aggregate``): numbers by median / min / max, booleans by ``all`` (a flag
holds only if it held in every repeat), equal-length lists of numbers or dicts
element by element, dicts key by key (keys present in every repeat), anything else
kept only when every repeat has the same value (per-request rows stay in
``repeats``). No best-of-N anywhere.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import provenance

_MISSING = object()

#: keys whose values stay per repeat only (per-request rows, time series)
PER_REPEAT_ONLY = frozenset({"requests", "samples", "provenance"})


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and every value, in order."""
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "repeats": vals}


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _combine(values: list[Any], how: Callable[[list[float]], float]) -> Any:
    first = values[0]
    if all(_is_num(v) for v in values):
        got = how([float(v) for v in values])
        # counts and indices stay ints where the median / min / max is one (a round number, a count)
        return int(got) if all(isinstance(v, int) for v in values) and got.is_integer() else got
    if all(isinstance(v, bool) for v in values):
        return all(values)
    if all(isinstance(v, dict) for v in values):
        out = {}
        for k in first:
            if k not in PER_REPEAT_ONLY and all(k in v for v in values):
                got = _combine([v[k] for v in values], how)
                if got is not _MISSING:
                    out[k] = got
        return out
    if (
        all(isinstance(v, list) for v in values)
        and len({len(v) for v in values}) == 1
        and all(_is_num(x) for v in values for x in v)
    ):
        return [how([float(v[i]) for v in values]) for i in range(len(first))]
    if (
        all(isinstance(v, list) for v in values)
        and len({len(v) for v in values}) == 1
        and all(isinstance(x, dict) for v in values for x in v)
    ):
        rows = [_combine([v[i] for v in values], how) for i in range(len(first))]
        return rows if all(r is not _MISSING for r in rows) else _MISSING
    if all(v == first for v in values):
        return first
    return _MISSING


def aggregate(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """``{**median, "min": ..., "max": ...}`` over ``repeats`` (see the module doc)."""
    if not repeats:
        raise ValueError("no repeats to aggregate")
    median = _combine(repeats, statistics.median)
    low = _combine(repeats, min)
    high = _combine(repeats, max)
    return {**median, "min": low, "max": high}


def measure(
    fn: Callable[[], dict[str, Any]],
    repeats: int,
    label: str = "repeat",
    vllm_venv: Path | None = None,
    uses_vllm: bool = False,
) -> dict[str, Any]:
    """Run ``fn`` ``repeats`` times (each with its own provenance) and aggregate."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1, got %d" % repeats)
    runs: list[dict[str, Any]] = []
    for _ in tqdm(range(repeats), desc=label, unit="repeat", leave=False, disable=repeats == 1):
        with provenance.record(vllm_venv, uses_vllm) as prov:
            got = fn()
        runs.append({**got, "provenance": prov.to_dict()})
    return _combined(runs)


def _combined(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats (each with its ``provenance``) as the aggregate beside every repeat."""
    bare = [{k: v for k, v in r.items() if k != "provenance"} for r in runs]
    return {
        **aggregate(bare),
        "repeats": runs,
        "repeat_count": len(runs),
        "provenance": [r["provenance"] for r in runs],
    }


def provenances(variants: dict[str, Any]) -> list[dict[str, Any]]:
    """Every repeat's provenance in ``variants`` (``{name: measure(...)}``)."""
    return [p for v in variants.values() for p in v.get("provenance", [])]


def measure_variants(
    fns: Mapping[str, Callable[[], dict[str, Any]]],
    repeats: int,
    vllm_venvs: Mapping[str, Path | None] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Run every variant ``repeats`` times, interleaved (A B C, A B C, ...: a slow
    minute of the machine falls on every variant, not on one), each repeat with
    its own provenance; returns ``({name: aggregated}, notes)``. A variant whose
    function raises ``FileNotFoundError`` (a missing environment) is left out with
    a note. ``vllm_venvs[name]``: the environment vLLM runs in for that variant
    (its version is recorded)."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1, got %d" % repeats)
    vllm_venvs = vllm_venvs or {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in fns}
    notes: dict[str, str] = {}
    for r in range(repeats):
        for name, fn in fns.items():
            if name in notes:
                continue
            if repeats > 1:
                print("[bench] %s: repeat %d of %d" % (name, r + 1, repeats), flush=True)
            venv = vllm_venvs.get(name)
            try:
                with provenance.record(venv, uses_vllm=name in vllm_venvs) as prov:
                    got = fn()
            except FileNotFoundError as exc:
                notes[name] = "left out: %s" % exc
                continue
            runs[name].append({**got, "provenance": prov.to_dict()})
    return {name: _combined(rs) for name, rs in runs.items() if name not in notes and rs}, notes


def repeat_views(variants: dict[str, Any]) -> list[dict[str, Any]]:
    """``variants`` as one ``{name: that repeat's result}`` per repeat index (as many
    as the variant with the most repeats has; a variant with fewer is in the first
    ones only): per-request checks run on each, so every repeat is checked."""
    n = max((len(v.get("repeats", [v])) for v in variants.values()), default=0)
    return [
        {name: reps[i] for name, v in variants.items() for reps in [v.get("repeats", [v])] if i < len(reps)}
        for i in range(n)
    ]
