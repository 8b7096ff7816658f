"""Shared output for benchmarks: a JSON file plus a bar plot beside it."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

from bench import provenance, repeats


def machine_info() -> dict[str, Any]:
    """When the file was written, from which commit (dirty or not), on what machine
    (``provenance.machine()``: CPU model and flags, torch's CPU capability, cores,
    memory, kernel, machine id). Each measured unit also has its own
    ``provenance`` (bench/provenance.py)."""
    commit, dirty = provenance.git_state()
    return {
        "written_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": commit,
        "dirty": dirty,
        "machine": platform.machine(),
        **provenance.machine(),
        "python": platform.python_version(),
    }


def run_summary(variants: dict[str, Any]) -> dict[str, Any]:
    """``same_run`` (computed from the variants' recorded times, commits and machines;
    false where a variant has no provenance) and the span."""
    recs = repeats.provenances(variants)
    same = provenance.variants_same_run(variants.values())
    return {"same_run": same, **provenance.span(recs)} if recs else {"same_run": False}


def previous_variants(json_path: Path, workload: dict[str, Any], quick: bool) -> dict[str, Any]:
    """The variants already in ``json_path`` when it holds a run of this same workload
    (``--variant`` reruns merge into them); else none."""
    try:
        old = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return {}
    if old.get("workload") != workload or old.get("quick") != quick:
        return {}
    return dict(old.get("variants", {}))


def write_json(path: Path, out: dict[str, Any]) -> None:
    """Add machine info (and, for variants, ``run``: same_run and span) to ``out``
    (in place) and write it to ``path`` as JSON."""
    out["machine"] = machine_info()
    if isinstance(out.get("variants"), dict):
        out["run"] = run_summary(out["variants"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


def write_report(path: Path, data: dict[str, Any], bars: dict[str, float], ylabel: str, title: str) -> None:
    """Write ``data`` (plus machine info) to ``path`` and a PNG bar plot of ``bars``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**data, "machine": machine_info()}
    path.write_text(json.dumps(data, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(bars), list(bars.values()), color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"][: len(bars)])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    for i, v in enumerate(bars.values()):
        ax.annotate("%.3g" % v, (i, v), ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)
    plt.close(fig)


def plot_bars(path: Path, panels: dict[str, dict[str, float]], title: str) -> None:
    """One bar chart per panel, side by side, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (name, bars) in zip(axes, panels.items(), strict=True):
        ax.bar(list(bars), list(bars.values()), color="#4c72b0")
        ax.set_title(name, fontsize=10)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        for i, v in enumerate(bars.values()):
            ax.annotate("%.3g" % v, (i, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_grouped(path: Path, panels: dict[str, dict[str, dict[str, float]]], title: str) -> None:
    """One grouped bar chart per panel (``{series: {group: value}}``: a bar per
    series in each group), side by side, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5))
    axes = axes if len(panels) > 1 else [axes]
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    for ax, (name, series) in zip(axes, panels.items(), strict=True):
        groups = list(dict.fromkeys(g for s in series.values() for g in s))
        width = 0.8 / max(len(series), 1)
        for i, (label, values) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
            ax.bar(xs, [values.get(g, 0.0) for g in groups], width, label=label, color=colors[i % len(colors)])
        ax.set_xticks(range(len(groups)), groups, rotation=30, fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _dig(d: Any, path: tuple[str | int, ...]) -> Any:
    for k in path:
        if isinstance(k, int) and isinstance(d, list) and -len(d) <= k < len(d):
            d = d[k]
        elif isinstance(k, str) and isinstance(d, dict) and k in d:
            d = d[k]
        else:
            return None
    return d


def spread(v: dict[str, Any], *path: str | int, spec: str = "%.1f", scale: float = 1.0) -> str:
    """The median at ``v[path]`` (``spec``, times ``scale``), followed by ``(min-max)``
    of the repeats when they differ, e.g. ``842.8 (800.1-901.3)``; ``-`` when absent."""
    med = _dig(v, path)
    if med is None:
        return "-"
    text = spec % (med * scale)
    low, high = _dig(v.get("min"), path), _dig(v.get("max"), path)
    if low is not None and high is not None and (spec % (low * scale) != text or spec % (high * scale) != text):
        text += " (%s-%s)" % (spec % (low * scale), spec % (high * scale))
    return text
