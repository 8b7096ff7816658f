"""The multi-turn benchmark's checks (issue #17's done-when, #26's and #25's
budgets), judged on a run's variants (pure; ``bench.multi_turn`` holds the
plan and the arithmetic they read).

Contract: the per-request checks hold in every repeat (``bench.repeats``);
every check that compares two variants reads ``NOT_COMPARABLE`` unless the two
are one run (``bench.provenance``); the keys are those of the results JSON's
``checks`` (``tests/unit/test_bench_multi_turn.py``).
"""

from __future__ import annotations

import itertools
from typing import Any


def predicted_hit(prev_prompt: int, prev_completion: int, unit: int) -> int:
    """Where the answer checkpoint of the previous turn lies (docs/DESIGN.md section 4,
    EAGLE off): the tail of prompt + answer, ``checkpoint_position(P + C, u) =
    (P + C - 1) // u * u``. The next turn's prompt starts with those ids (the
    router recalls them), so this is its hit, computed from the protocol alone."""
    return max(prev_prompt + prev_completion - 1, 0) // unit * unit


#: the variants with answer checkpoints, and their checks' key
ANSWER_VARIANTS = {"answers-cached": "answers_cached", "stack-vllm": "stack_vllm"}
#: issue #26's budgets for ``stack-vllm``: answer tokens hit, TTFT p50 against answers off
STACK_VLLM_ANSWER_HIT_MIN, STACK_VLLM_TTFT_MAX = 0.9, 1.1


def _kept(r: dict[str, Any]) -> int:
    """The previous answer's ids the router keeps (records of runs before
    ``answer_kept_tokens`` was recorded: the whole answer)."""
    return int(r.get("previous_answer_kept", r["answer_tokens"]))


def _checks_one(variants: dict[str, Any], unit: int) -> dict[str, Any]:
    """The per-request checks of one repeat (``{name: that repeat's result}``)."""
    out: dict[str, Any] = {}
    ac, po = variants.get("answers-cached"), variants.get("prompt-only")
    for name, key in ANSWER_VARIANTS.items():
        v = variants.get(name)
        if v is not None:
            out[key + "_over_bound"] = [
                "user%d/round%d" % (r["user"], r["round"])
                for r in v["requests"]
                if r["round"] >= 2 and r["recomputed_tokens"] > r["ideal_tokens"] + unit
            ]
    if ac is not None:
        later = [r for r in ac["requests"] if r["round"] >= 2]
        prev = {(r["user"], r["round"]): r for r in ac["requests"]}
        out["answers_cached_hit_not_predicted"] = [
            "user%d/round%d: cached %d, protocol %d" % (r["user"], r["round"], r["cached_tokens"], want)
            for r in later
            for p in [prev[(r["user"], r["round"] - 1)]]
            for want in [predicted_hit(p["prompt_tokens"], _kept(r), unit)]
            if r["cached_tokens"] != want
        ]
    if po is not None:
        out["prompt_only_not_recomputing_answer"] = [
            "user%d/round%d" % (r["user"], r["round"])
            for r in po["requests"]
            if r["round"] >= 2 and r["recomputed_tokens"] < r["ideal_tokens"] + _kept(r)
        ]
    for name in ("answers-cached", "prompt-only"):
        v = variants.get(name)
        if v is not None:
            out[name.replace("-", "_") + "_handoff_over_bound"] = [
                "user%d/round%d: read %d > bound %.0f" % (r["user"], r["round"], r["handoff_bytes"], bound)
                for r in v["requests"]
                for bound in [r.get("handoff_bound_bytes")]
                if r["round"] >= 2 and bound is not None and r["handoff_bytes"] > bound
            ]
    nc = variants.get("nocache")
    if ac is not None and nc is not None:
        # both build each prompt from the recalled ids: greedy answers must be equal (exactness)
        texts = [[r.get("answer_text") for r in v["requests"]] for v in (ac, nc)]
        out["outputs_equal"] = texts[0] == texts[1]
    return out


def checks(variants: dict[str, Any], unit: int) -> dict[str, Any]:
    """Issue #17's done-when, each part compared with an independent reference and
    judged in every repeat (``variants``: ``{name: bench.repeats`` aggregate or one
    run``}``):

    * ``answers_cached_ok``: every rounds->=2 request of ``answers-cached``
      recomputes at most its ideal + one unit (the ideal counts the template
      tokens; the answer checkpoint lies at the last unit boundary of prompt + answer);
    * ``answers_cached_hits_protocol``: its cached tokens equal the answer
      checkpoint's position by the protocol's arithmetic (``predicted_hit``);
    * ``prompt_only_recomputes_answer``: every rounds->=2 request of
      ``prompt-only`` recomputes at least its ideal + the previous answer;
    * ``answers_cached_outputs_equal_nocache``: the same greedy answers as the
      no-cache run of the same prompts, from one run (same commit and machine);
    * ``same_run``: computed from every variant's recorded provenance (times,
      commit and machine, bench/provenance.py), never assumed: the variants run
      interleaved, so two of them form one sitting only with the repeats of the
      others between them; ``done_when`` needs it.

    Every check that compares two variants (outputs, TTFT ratios, the cached
    share against vllm-pd) reads ``NOT_COMPARABLE`` unless the two are one run.
    """
    from bench.provenance import judged, variants_same_run
    from bench.repeats import repeat_views

    per = [_checks_one(v, unit) for v in repeat_views(variants)]
    out: dict[str, Any] = {"unit": unit, "repeats_checked": len(per)}

    def failures(key: str) -> list[str]:
        return ["repeat %d: %s" % (i + 1, x) for i, c in enumerate(per) for x in c.get(key, [])]

    ac, po, nc = (variants.get(k) for k in ("answers-cached", "prompt-only", "nocache"))
    if ac is not None:
        out["answers_cached_bound"] = "recomputed <= ideal + unit, per request"
        out["answers_cached_over_bound"] = failures("answers_cached_over_bound")
        out["answers_cached_ok"] = not out["answers_cached_over_bound"]
        out["answers_cached_hit_not_predicted"] = failures("answers_cached_hit_not_predicted")
        out["answers_cached_hits_protocol"] = not out["answers_cached_hit_not_predicted"]
    for name in ("answers-cached", "prompt-only"):
        v = variants.get(name)
        key = name.replace("-", "_") + "_handoff"
        if v is not None and v.get("handoff_bound_bytes_per_request") is not None:
            out[key + "_bound"] = "handoff bytes <= (new tokens + u) x KV bytes per token + state + draft, rounds >= 2"
            out[key + "_over_bound"] = failures(key + "_over_bound")
            out[key + "_ok"] = not out[key + "_over_bound"]
    if po is not None:
        out["prompt_only_bound"] = "recomputed >= ideal + previous answer, per request"
        out["prompt_only_not_recomputing_answer"] = failures("prompt_only_not_recomputing_answer")
        out["prompt_only_recomputes_answer"] = not out["prompt_only_not_recomputing_answer"]
    if ac is not None and nc is not None:
        equal = {"answers_cached_outputs_equal_nocache": all(c.get("outputs_equal", False) for c in per)}
        out.update(judged(variants_same_run([ac, nc]), equal))
    if ac is not None and po is not None:
        out["same_run"] = variants_same_run(variants.values())
        out["done_when"] = bool(out["answers_cached_ok"] and out["prompt_only_recomputes_answer"] and out["same_run"])
    sv, svp = variants.get("stack-vllm"), variants.get("stack-vllm-prompt-only")
    if sv is not None:
        out["stack_vllm_over_bound"] = failures("stack_vllm_over_bound")
        out["stack_vllm_ok"] = not out["stack_vllm_over_bound"]
        hit = sv.get("answer_tokens_hit_ratio")
        out["stack_vllm_answer_hit_ratio"] = hit
        out["stack_vllm_answer_hit_ok"] = hit is not None and hit >= STACK_VLLM_ANSWER_HIT_MIN
    if sv is not None and svp is not None:
        a, b = sv.get("ttft_p50_ms"), svp.get("ttft_p50_ms")
        same = variants_same_run([sv, svp])
        ratio = {"stack_vllm_ttft_ratio": a / b if a and b else None}
        ratio["stack_vllm_ttft_ok"] = bool(a and b and a / b <= STACK_VLLM_TTFT_MAX)
        out.update(judged(same, ratio))
        out["stack_vllm_same_run"] = same
    for ours, theirs in itertools.product(("stack-vllm", "stack-vllm-1p1d"), ("vllm-pd", "vllm-pd-shipped")):
        if ours in variants and theirs in variants:
            out.update(_against_vllm_pd(variants[ours], variants[theirs], ours, theirs))
    return out


def _against_vllm_pd(
    sv: dict[str, Any], pd: dict[str, Any], ours: str = "stack-vllm", theirs: str = "vllm-pd"
) -> dict[str, Any]:
    """#25's budget on multi-turn: our stack (``ours``: stack-vllm, 2 prefill + 1 decode,
    or stack-vllm-1p1d, engine for engine vLLM's P/D) caches a larger share of its
    prompt tokens than vLLM's P/D (``theirs``: vllm-pd or vllm-pd-shipped; rounds >= 2;
    the two tokenize their answers differently, so shares, not counts) and its TTFT
    p50 is below. Each share is its own variant's figure; the comparisons read
    ``NOT_COMPARABLE`` unless the two are one run."""
    from bench.provenance import judged, variants_same_run

    a_key, b_key = ours.replace("-", "_"), theirs.replace("-", "_")
    shares = [v["cached_tokens_per_request"] / v["prompt_tokens_per_request"] for v in (sv, pd)]
    a, b = sv.get("ttft_p50_ms"), pd.get("ttft_p50_ms")
    compared = {
        "%s_cached_above_%s" % (a_key, b_key): shares[0] > shares[1],
        "%s_ttft_p50_vs_%s" % (a_key, b_key): a / b if a and b else None,
        "%s_ttft_below_%s" % (a_key, b_key): bool(a and b and a < b),
    }
    return {
        "%s_cached_share" % a_key: shares[0],
        "%s_cached_share" % b_key: shares[1],
        **judged(variants_same_run([sv, pd]), compared),
    }
