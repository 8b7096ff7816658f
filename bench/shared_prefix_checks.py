"""The shared-prefix benchmark's checks, judged on a run's variants (pure):
hit ratios against the ideal, placement (#27), 4 routers against one (#30),
dense retention (#26) and TTFT against vLLM's own P/D (#25).

Contract: every check that compares variants reads ``NOT_COMPARABLE`` unless
they are one run (``bench.provenance.same_run``); the keys are those of the
results JSON's ``checks`` (``tests/unit/test_bench_shared_prefix.py``).
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.provenance import judged, variants_same_run
from bench.shared_prefix_variants import (
    PD_BASELINES,
    PLACEMENT_OFF,
    ROUTERS_VARIANT,
    STACK_VLLM,
    STACK_VLLM_1P1D,
    STACK_VLLM_DENSE,
    STACK_VLLM_NO_STORE,
    STACK_VLLM_NO_TAIL,
    VLLM_VARIANTS,
)

#: #27's done-when: the second request of a two-sharer pair reuses this much of the document
TWO_SHARER_BOUND = 0.75


def _placement_checks(results: dict[str, Any], bound: float) -> dict[str, Any]:
    """#27 on token-id prompts: ``branch-aware`` (placement on) reuses at least
    ``TWO_SHARER_BOUND`` of a prefix two requests share, reaches ``bound`` of the
    fan-out's ideal counted from the second conversation (``hit_ratio_all``: the first
    has an ideal of 0), and is no worse than ``PLACEMENT_OFF`` on any other phase (a
    comparison: ``NOT_COMPARABLE`` unless the two are one run)."""
    ours = results["branch-aware"]["phases"]
    out: dict[str, Any] = {}
    if "twosharer_ids" in ours:
        out["two_sharer_ids_ok"] = ours["twosharer_ids"]["hit_ratio"] >= TWO_SHARER_BOUND
    out["fanout_ids_from_second_ok"] = ours["fanout_ids"]["hit_ratio_all"] >= bound
    if PLACEMENT_OFF in results:
        off = results[PLACEMENT_OFF]["phases"]
        worse = sorted(
            "%s: %.3f vs %.3f" % (p, x["hit_ratio_all"], off[p]["hit_ratio_all"])
            for p, x in ours.items()
            if p in off and x["hit_ratio_all"] < off[p]["hit_ratio_all"]
        )
        same = variants_same_run([results["branch-aware"], results[PLACEMENT_OFF]])
        out.update(judged(same, {"placement_worse_than_off": worse, "placement_no_worse_ok": not worse}))
    return out


#: a hit ratio at the ideal (ratios are rounded sums of whole tokens: 1.0 exactly)
IDEAL_RATIO = 1.0


def _retention_checks(results: dict[str, Any]) -> dict[str, Any]:
    """#26's state budget on vLLM: dense retention (``STACK_VLLM_DENSE``) against
    stack-vllm's 0, as ratios of the hit rate over all phases and of the prefill
    instances' cached pages after the plan (``prefill_cache``); empty without it,
    ``NOT_COMPARABLE`` unless the two are one run."""
    if STACK_VLLM_DENSE not in results or STACK_VLLM not in results:
        return {}
    dense, zero = results[STACK_VLLM_DENSE], results[STACK_VLLM]
    held = [(v.get("prefill_cache") or {}).get("cached_mib") for v in (dense, zero)]
    ratios = {
        "retention_dense_hit_ratio": dense["hit_ratio_all_phases"] / zero["hit_ratio_all_phases"],
        "retention_dense_cached_mib_ratio": held[0] / held[1] if held[0] is not None and held[1] else None,
    }
    return judged(variants_same_run([dense, zero]), ratios)


def plan_ttft_p50(variant: dict[str, Any]) -> float | None:
    """TTFT p50 over every request of the plan (all phases, counted or not), the
    median over the repeats (a single run: its own); None without per-request records."""
    reps = variant.get("repeats") or [variant]
    p50s = [statistics.median(r["ttft_ms"] for r in rep["requests"]) for rep in reps if rep.get("requests")]
    return statistics.median(p50s) if p50s else None


def _ttft_checks(results: dict[str, Any]) -> dict[str, Any]:
    """#25's budgets: ``stack-vllm`` (2 prefill + 1 decode) and, where they ran,
    ``stack-vllm-1p1d`` (engine for engine vllm-pd's two), ``stack-vllm-no-tail-stage``
    and ``stack-vllm-no-store`` against each of ``PD_BASELINES`` that ran: the TTFT p50
    ratio per phase (medians of the repeats) and the phases where ours is not below;
    over the whole plan (``plan_ttft_p50``: the workload's TTFT p50); and the phases
    where ours caches no more (counted requests).
    Each stack's checks read ``NOT_COMPARABLE`` unless it and that baseline are one run."""
    out: dict[str, Any] = {}
    for base in (b for b in PD_BASELINES if b in results):
        pd = results[base]["phases"]
        pd_plan = plan_ttft_p50(results[base])
        vs = base.replace("-", "_")
        for name in (STACK_VLLM, STACK_VLLM_1P1D, STACK_VLLM_NO_TAIL, STACK_VLLM_NO_STORE):
            if name not in results:
                continue
            key = name.replace("-", "_")
            ours = results[name]["phases"]
            one: dict[str, Any] = {}
            one["%s_cached_not_above_%s" % (key, vs)] = sorted(
                p for p, x in ours.items() if p in pd and not x.get("cached_tokens", 0) > pd[p].get("cached_tokens", 0)
            )
            ratios = {p: x["ttft_p50_ms"] / pd[p]["ttft_p50_ms"] for p, x in ours.items() if p in pd}
            one["%s_ttft_p50_vs_%s" % (key, vs)] = {p: round(r, 3) for p, r in ratios.items()}
            one["%s_ttft_not_below_%s" % (key, vs)] = sorted(p for p, r in ratios.items() if not r < 1.0)
            one["%s_ttft_below_%s" % (key, vs)] = not one["%s_ttft_not_below_%s" % (key, vs)]
            plan = plan_ttft_p50(results[name])
            if plan is not None and pd_plan:
                one["%s_plan_ttft_p50_vs_%s" % (key, vs)] = round(plan / pd_plan, 3)
                one["%s_plan_ttft_below_%s" % (key, vs)] = plan < pd_plan
            out.update(judged(variants_same_run([results[name], results[base]]), one))
    return out


def checks(results: dict[str, Any], bound: float = 0.9) -> dict[str, Any]:
    """``branch-aware`` and ``stack-vllm`` at least ``bound`` of the ideal on every
    phase (counted requests); ``stack-vllm`` above ``vllm-direct`` and ``vllm-pd``
    on every phase (``stack_vllm_not_above``: the phases where it is not, with
    both ratios; ``stack_vllm_above_vllm_or_ideal`` also counts a phase where
    stack-vllm is at the ideal, which no variant can be above), from one run
    (``stack_vllm_same_run``, from the provenance); every chat prompt's token count equal to the server's.
    Every check that compares variants reads ``NOT_COMPARABLE`` unless they are one
    run (one clean commit, one machine, one sitting: ``bench.provenance.same_run``)."""
    out: dict[str, Any] = {"prompt_tokens_match": {k: v["prompt_tokens_match"] for k, v in results.items()}}
    if "branch-aware" in results:
        out.update(_placement_checks(results, bound))
    if "branch-aware" in results and ROUTERS_VARIANT in results:
        # 4 routers sharing the index hit as much as one (#30: within 2 %)
        ratio = results[ROUTERS_VARIANT]["hit_ratio_all_phases"] / results["branch-aware"]["hit_ratio_all_phases"]
        same = variants_same_run([results[ROUTERS_VARIANT], results["branch-aware"]])
        out.update(judged(same, {"routers_hit_ratio_ratio": ratio, "routers_hit_ratio_ok": ratio >= 0.98}))
    for name, key in (("branch-aware", "branch_aware"), (STACK_VLLM, "stack_vllm")):
        if name in results:
            ratios = {p: x["hit_ratio"] for p, x in results[name]["phases"].items()}
            out[key + "_hit_ratio_min"] = bound
            out[key + "_ok"] = all(r >= bound for r in ratios.values())
            out[key + "_below"] = sorted(p for p, r in ratios.items() if not r >= bound)
    theirs = [n for n in VLLM_VARIANTS if n in results]
    if STACK_VLLM in results and theirs:
        ours = results[STACK_VLLM]["phases"]
        above: dict[str, Any] = {}
        above["stack_vllm_not_above"] = sorted(
            "%s: %.3f vs %s %.3f" % (p, x["hit_ratio"], n, results[n]["phases"][p]["hit_ratio"])
            for p, x in ours.items()
            for n in theirs
            if not x["hit_ratio"] > results[n]["phases"][p]["hit_ratio"]
        )
        above["stack_vllm_above_vllm"] = not above["stack_vllm_not_above"]
        # where a baseline already reaches the ideal nothing can be above it: at the ideal too counts
        above["stack_vllm_not_above_or_ideal"] = sorted(
            "%s: %.3f vs %s %.3f" % (p, x["hit_ratio"], n, results[n]["phases"][p]["hit_ratio"])
            for p, x in ours.items()
            for n in theirs
            if not (x["hit_ratio"] > results[n]["phases"][p]["hit_ratio"] or x["hit_ratio"] >= IDEAL_RATIO)
        )
        above["stack_vllm_above_vllm_or_ideal"] = not above["stack_vllm_not_above_or_ideal"]
        same = variants_same_run([results[n] for n in (STACK_VLLM, *theirs)])
        out.update(judged(same, above))
        out.update(_retention_checks(results))
        out.update(_ttft_checks(results))
        out["stack_vllm_same_run"] = same
    return out
