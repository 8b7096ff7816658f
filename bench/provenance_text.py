"""How a results file's origin and checks read in bench/README.md: the provenance
line of a block (dates, commits, load, the machine, versions, repeats, whether the
variants are one run) and its checks paragraph, where a comparison across runs,
commits or machines reads "not comparable" (``COMPARISONS``). A result recorded
from a dirty tree is refused (``DirtyResultError``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from bench import provenance

#: checks that compare variants: they read "not comparable" unless those variants are one run
COMPARISONS = re.compile(
    r"^(routers_hit_rat(e|io)_(ratio|ok)"
    r"|partial_eagle_caches_as_partial|partial_caches_more_than_aligned"
    r"|placement_(worse_than_off|no_worse_ok)"
    r"|stack_vllm_(not_above|above_vllm)(_or_ideal)?"
    r"|retention_\w+"
    r"|(?!vllm_pd(_shipped)?_cached_share$)\w*vllm_pd\w*"
    r"|answers_cached_outputs_equal_nocache"
    r"|stack_vllm_ttft_(ratio|ok)|done_when"
    r"|batch_\d+_not_lower)$"
)
#: a check that says whether variants are one run: recomputed where the file's are not
SAME_RUN_CHECK = re.compile(r"^(\w+_)?same_run$")


class DirtyResultError(ValueError):
    """A results file recorded from a tree with uncommitted code changes."""


def records(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Every provenance record in a results file (top level, per repeat, per variant)."""
    found: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            p = x.get("provenance")
            if isinstance(p, dict) and "commit" in p:
                found.append(p)
            elif isinstance(p, list):
                found.extend(r for r in p if isinstance(r, dict) and "commit" in r)
            for k, v in x.items():
                if k not in ("provenance", "repeats"):
                    walk(v)

    walk(out)
    unique = {(r["commit"], r["started"]): r for r in found}
    return sorted(unique.values(), key=lambda r: r["started"])


def _repeat_counts(out: dict[str, Any]) -> list[int]:
    if isinstance(out.get("variants"), dict):
        return sorted({int(v.get("repeat_count", 1)) for v in out["variants"].values()})
    for key in ("repeat_count", "repeats"):
        if isinstance(out.get(key), int):
            return [out[key]]
    return [1]


def _machine_text(recs: list[dict[str, Any]]) -> str:
    """Each machine kind of ``recs`` with what the records say of it."""
    kinds: dict[str, dict[str, Any]] = {}
    for r in recs:
        kinds.setdefault(provenance.machine_kind(r.get("machine")), r.get("machine") or {})
    texts = []
    for kind, m in kinds.items():
        bits = [kind, "%s CPUs" % m.get("cpus", "?")]
        if m.get("torch_cpu_capability"):
            bits.append("torch CPU capability %s" % m["torch_cpu_capability"])
        if m.get("memory_gib"):
            bits.append("%s GiB" % m["memory_gib"])
        if m.get("kernel"):
            bits.append("kernel %s" % m["kernel"])
        texts.append(", ".join(bits))
    many = " (**%d machine kinds**)" % len(kinds) if len(kinds) > 1 else ""
    return "on " + " and ".join(texts) + many


def provenance_line(name: str, out: dict[str, Any], whole: dict[str, Any] | None = None) -> str:
    """Where the numbers of ``out`` come from, in one paragraph; whether the variants
    of ``whole`` (the file, where ``out`` is one machine kind's part) are one run."""
    recs = records(out)
    if not recs:
        m = out.get("machine", {})
        return (
            "_`%s`: written %s at commit %s, before runs kept their provenance (no machine, dirty flag, load or"
            " versions recorded; one run, no repeats): a record, not a headline._\n"
            % (name, m.get("date") or m.get("written_utc", "?"), str(m.get("commit", "?"))[:7])
        )
    dirty = [r for r in recs if r["dirty"]]
    if dirty:
        raise DirtyResultError(
            "%s: recorded from a dirty tree at %s (commit %s): rerun it from a clean checkout"
            % (name, dirty[0]["started_utc"], dirty[0]["commit"][:7])
        )
    span = provenance.span(recs)
    versions: dict[str, set[str]] = {}
    for r in recs:
        for k, v in r.get("versions", {}).items():
            if v:
                versions.setdefault(k, set()).add(v)
    load = [x for r in recs for x in (r["load_average_before"][0], (r.get("load_average_after") or [0])[0])]
    counts = _repeat_counts(out)
    parts = [
        "`%s`: run %s to %s, commit %s"
        % (name, span["started_utc"], span["ended_utc"], ", ".join(c[:7] for c in span["commits"])),
        "%s repeat%s%s"
        % ("/".join(map(str, counts)), "s" if counts != [1] else "", " per variant" if "variants" in out else ""),
        "load average (1 min) %.1f-%.1f" % (min(load), max(load)),
        _machine_text(recs),
        ", ".join("%s %s" % (k, "/".join(sorted(v))) for k, v in sorted(versions.items())),
    ]
    variants = (whole or out).get("variants")
    if isinstance(variants, dict) and len(variants) > 1:
        why = provenance.variants_difference(variants.values())
        parts.append("the variants are one run" if why is None else "the variants are **not** one run (%s)" % why)
    return "_" + "; ".join(parts) + "._\n"


def value_text(v: Any) -> str:
    if isinstance(v, bool):
        return "holds" if v else "**MISSED**"
    if isinstance(v, float):
        return "%.4g" % v
    if isinstance(v, list) and not v:
        return "none"
    return "`%s`" % json.dumps(v) if not isinstance(v, str) else v


def difference(name: str, out: dict[str, Any]) -> str | None:
    """None where the comparisons of block ``name``'s file may be judged (its
    variants are one run), else why not."""
    if isinstance(out.get("variants"), dict):
        return provenance.variants_difference(out["variants"].values())
    return None


def checks_lines(out: dict[str, Any], why: str | None = None) -> str:
    """The file's ``checks`` in one paragraph (a false check reads MISSED). Where the
    variants are not one run (``why``), a comparison reads "not comparable" and a
    ``same_run`` check says why it is missed."""
    checks = out.get("checks")
    if not checks:
        return ""
    items = []
    for k, v in checks.items():
        shown = value_text(v)
        if why is not None and COMPARISONS.match(k):
            shown = provenance.NOT_COMPARABLE
        elif why is not None and SAME_RUN_CHECK.match(k):
            shown = "**MISSED** (%s)" % why
        items.append("`%s` %s" % (k, shown))
    head = "Checks (`checks` in the JSON, judged on the medians; per-request bounds in every repeat): "
    return "\n" + head + "; ".join(items) + ".\n"
