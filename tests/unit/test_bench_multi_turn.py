"""The multi-turn benchmark's plan and arithmetic (bench/multi_turn.py), without a stack."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from click.testing import CliRunner

from bench.multi_turn import QUICK, Workload, build_plan, per_request, shared_round1, summarize
from bench.multi_turn_checks import checks


def rec(user: int, rnd: int, prompt: int, cached: int, completion: int = 128, ttft: float = 10.0, **kw: Any) -> dict:
    return {
        "user": user,
        "round": rnd,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "ttft_ms": ttft,
        **kw,
    }


#: two users, three rounds, in sending order (round-major); 128-token answers
RECORDS = [
    rec(1, 1, 278, 0, shared_tokens=0, ttft=50.0),
    rec(2, 1, 255, 208, shared_tokens=213, ttft=20.0),
    # user 1 round 2: grew by 54 past prompt + answer (278 + 128 = 406); cached 400 = 122 answer tokens
    rec(1, 2, 460, 400, ttft=30.0),
    # user 2 round 2: 255 + 128 = 383 before; 438 - 383 = 55 new; cached 368 = 113 of the answer
    rec(2, 2, 438, 368, ttft=40.0),
    # user 1 round 3: 460 + 128 = 588; 642 - 588 = 54; cached only the previous prompt's 448 (no answer)
    rec(1, 3, 642, 448, ttft=60.0),
    # user 2 round 3: cached less than the previous prompt (clamped to 0 answer tokens)
    rec(2, 3, 619, 432, ttft=70.0),
]


def test_per_request_exact() -> None:
    rs = per_request(RECORDS)
    assert [r["recomputed_tokens"] for r in rs] == [278, 47, 60, 70, 194, 187]
    # round 1: prompt - shared system prompt part; rounds >= 2: prompt - (previous prompt + completion)
    assert [r["ideal_tokens"] for r in rs] == [278, 42, 54, 55, 54, 53]
    assert [r["answer_tokens"] for r in rs] == [0, 0, 128, 128, 128, 128]
    # cached past the previous prompt, clamped to [0, previous completion]
    assert [r["answer_hit_tokens"] for r in rs] == [None, None, 122, 113, 0, 0]
    # past the whole answer (cached reaches into the new message): at most the answer
    more = per_request([rec(1, 1, 100, 0, completion=64), rec(1, 2, 300, 240)])
    assert more[1]["answer_hit_tokens"] == 64 and more[1]["ideal_tokens"] == 300 - 164


def test_summarize_overall_counts_rounds_two_on() -> None:
    metric = {"metric_answer_hit": 0, "metric_answer_recomputed": 0}
    retok = {"metric_retokenized_same": 0, "metric_retokenized_differs": 0}
    rows = [dict(r) for r in RECORDS]
    rows[2] |= {"metric_answer_hit": 122, "metric_answer_recomputed": 6, "metric_retokenized_differs": 1}
    rows[3] |= {"metric_answer_hit": 113, "metric_answer_recomputed": 15, "metric_retokenized_same": 1}
    rows[4] |= {"metric_answer_hit": 0, "metric_answer_recomputed": 128, "metric_retokenized_differs": 1}
    rows[5] |= {"metric_answer_hit": 0, "metric_answer_recomputed": 128, "metric_retokenized_same": 1}
    for i, r in enumerate(rows):
        rows[i] = metric | retok | r
        rows[i]["retokenized_differs"] = i % 2 == 0
        if r["round"] >= 2:
            rows[i]["suffix_tokens"] = r["prompt_tokens"] - 500  # made up: the sum is what counts
    out = summarize(rows)
    assert out["num_requests"] == 4
    assert out["suffix_tokens_per_request"] == (460 + 438 + 642 + 619 - 4 * 500) / 4
    assert out["recomputed_tokens_per_request"] == (60 + 70 + 194 + 187) / 4
    assert out["ideal_tokens_per_request"] == (54 + 55 + 54 + 53) / 4
    assert out["recomputed_minus_ideal_max"] == 194 - 54 and out["recomputed_minus_ideal_min"] == 6
    assert out["answer_hit_tokens"] == 235
    assert out["answer_tokens_hit_ratio"] == 235 / 512
    assert out["answer_tokens_hit_ratio_metric"] == 235 / 512
    assert out["answer_tokens_metric"] == {"hit": 235, "recomputed": 277}
    assert out["answers_recalled"] == 4 and out["retokenized_differs_ratio"] == 0.5
    assert out["retokenized_differs_ratio_client"] == 0.5  # rows 2 and 4 (even indices) of rounds >= 2
    assert out["retokenized_differs_ratio_nonspecial"] is None
    assert out["ttft_p50_ms"] == 50.0 and out["ttft_p90_ms"] == 70.0
    r1, r2, r3 = out["per_round"]
    assert (r1["round"], r1["num_requests"], r1["ideal_tokens_per_request"]) == (1, 2, (278 + 42) / 2)
    assert r1["recomputed_tokens_per_request"] == (278 + 47) / 2
    assert r1["answer_tokens_hit_ratio"] is None  # no previous answer in round 1
    assert r1["ttft_p50_ms"] == 35.0  # median of two
    assert r2["answer_tokens_hit_ratio"] == 235 / 256 and r2["retokenized_differs_ratio"] == 0.5
    assert r3["answer_tokens_hit_ratio"] == 0.0 and r3["recomputed_tokens_per_request"] == (194 + 187) / 2
    assert len(out["requests"]) == 6


def test_summarize_without_router_counters() -> None:
    """vllm-direct, prompt-only: no router counters, the usage arithmetic only."""
    out = summarize(RECORDS)
    assert out["suffix_tokens_per_request"] is None
    assert out["answer_tokens_hit_ratio_metric"] is None and out["answer_tokens_metric"] is None
    assert out["retokenized_differs_ratio"] is None and out["retokenized_differs_ratio_client"] is None
    assert out["answer_tokens_hit_ratio"] == 235 / 512
    # a record with a missing counter makes the sum unknown, not smaller
    rows = [dict(r, metric_answer_hit=1, metric_answer_recomputed=1) for r in RECORDS]
    del rows[3]["metric_answer_hit"]
    assert summarize(rows)["answer_tokens_hit_ratio_metric"] is None


def _prov(started: float, commit: str = "c0", dirty: bool = False) -> dict:
    return {
        "commit": commit,
        "dirty": dirty,
        "started": started,
        "ended": started + 30.0,
        "load_average_before": [0.5, 0.5, 0.5],
        "load_average_after": [0.6, 0.5, 0.5],
        "machine": {"cpu": "Test CPU", "cpu_flags": ["avx2"], "machine_id": "m0"},
    }


def _variant(records: list[dict], started: float = 0.0, commit: str = "c0", **extra: Any) -> dict:
    """One repeat as bench.repeats.measure_variants records it."""
    one = {**summarize(records), **extra, "provenance": _prov(started, commit)}
    return {**one, "repeats": [one], "repeat_count": 1, "provenance": [one["provenance"]]}


def test_checks_done_when() -> None:
    u = 16
    cached = [rec(1, 1, 278, 0), rec(1, 2, 460, 400), rec(1, 3, 642, 576)]  # 60 <= 54 + 16; 66 <= 54 + 16
    prompt_only = [rec(1, 1, 278, 0), rec(1, 2, 460, 272), rec(1, 3, 642, 448)]  # 188 >= 54 + 128; 194 >= 182
    v = {"answers-cached": _variant(cached), "prompt-only": _variant(prompt_only, started=40.0)}
    out = checks(v, u)
    assert out["answers_cached_ok"] and out["answers_cached_over_bound"] == []
    # the hits are where the protocol puts the answer checkpoints: (278 + 128 - 1) // 16 * 16 = 400, then 576
    assert out["answers_cached_hits_protocol"] and out["answers_cached_hit_not_predicted"] == []
    assert out["prompt_only_recomputes_answer"] and out["same_run"] and out["done_when"]
    # one unit plus one token over the ideal: fails, named; and the hit is not the protocol's
    over = [rec(1, 1, 278, 0), rec(1, 2, 460, 389), rec(1, 3, 642, 576)]  # 71 > 54 + 16
    out = checks({**v, "answers-cached": _variant(over)}, u)
    assert not out["answers_cached_ok"] and out["answers_cached_over_bound"] == ["repeat 1: user1/round2"]
    assert out["answers_cached_hit_not_predicted"] == ["repeat 1: user1/round2: cached 389, protocol 400"]
    assert not out["done_when"]
    # a hit past the checkpoint the protocol allows is as wrong as one short of it
    more = [rec(1, 1, 278, 0), rec(1, 2, 460, 416), rec(1, 3, 642, 576)]
    assert not checks({**v, "answers-cached": _variant(more)}, u)["answers_cached_hits_protocol"]
    # prompt-only hitting part of the answer is not recomputing it
    partial = [rec(1, 1, 278, 0), rec(1, 2, 460, 288), rec(1, 3, 642, 448)]  # 172 < 182
    out = checks({**v, "prompt-only": _variant(partial, started=40.0)}, u)
    assert out["prompt_only_not_recomputing_answer"] == ["repeat 1: user1/round2"] and not out["done_when"]
    # interleaved with other variants (A B C, A B C): one sitting, though A and B alone leave a gap
    spaced = {
        "answers-cached": _variant(cached),
        "prompt-only": _variant(prompt_only, started=40.0),
        "vllm-pd": _variant(cached, started=230.0),
    }
    spaced["vllm-pd"]["provenance"][0]["ended"] = 400.0
    spaced["answers-cached"]["provenance"].append(_prov(410.0))  # 340 s after prompt-only ended
    assert checks(spaced, u)["same_run"]
    # from different runs (a --variant rerun merged hours later), or another commit, or a dirty tree
    out = checks({**v, "prompt-only": _variant(prompt_only, started=7200.0)}, u)
    assert not out["same_run"] and not out["done_when"]
    assert not checks({**v, "prompt-only": _variant(prompt_only, started=40.0, commit="c1")}, u)["same_run"]
    dirty = _variant(prompt_only, started=40.0)
    dirty["provenance"][0]["dirty"] = True
    assert not checks({**v, "prompt-only": dirty}, u)["same_run"]
    # answers-cached against nocache of the same commit: the same greedy answers
    texts = [dict(r, answer_text="a%d" % i) for i, r in enumerate(cached)]
    nc = _variant([dict(r, cached_tokens=0) for r in texts])
    assert checks({**v, "answers-cached": _variant(texts), "nocache": nc}, u)["answers_cached_outputs_equal_nocache"]
    nc["repeats"][0]["requests"][2]["answer_text"] = "other"
    assert not checks({**v, "answers-cached": _variant(texts), "nocache": nc}, u)[
        "answers_cached_outputs_equal_nocache"
    ]
    # no done_when without prompt-only
    assert "done_when" not in checks({"answers-cached": _variant(cached)}, u)


def test_checks_every_repeat() -> None:
    """A per-request bound must hold in every repeat, not in the median."""
    u = 16
    good = [rec(1, 1, 278, 0), rec(1, 2, 460, 400), rec(1, 3, 642, 576)]
    bad = [rec(1, 1, 278, 0), rec(1, 2, 460, 389), rec(1, 3, 642, 576)]
    reps = [_variant(x, started=40.0 * i)["repeats"][0] for i, x in enumerate((good, bad, good))]
    ac = {**summarize(good), "repeats": reps, "repeat_count": 3, "provenance": [r["provenance"] for r in reps]}
    out = checks({"answers-cached": ac}, u)
    assert out["repeats_checked"] == 3 and not out["answers_cached_ok"]
    assert out["answers_cached_over_bound"] == ["repeat 2: user1/round2"]


def test_shared_round1() -> None:
    assert shared_round1([[1, 2, 3, 4], [1, 2, 3, 5], [1, 9], [1, 2, 3, 5, 6]]) == [0, 3, 1, 4]


def toy_encode(text: str) -> list[int]:
    return [sum(map(ord, w)) % 2000 for w in text.split()]


def test_plan_shape_sizes_and_seed() -> None:
    w = Workload()
    plan = build_plan(w, toy_encode)
    assert len(plan.messages) == w.users and all(len(m) == w.rounds for m in plan.messages)
    assert len(toy_encode(plan.system)) == w.system_tokens  # one toy token per word
    sizes = [len(toy_encode(m)) for ms in plan.messages for m in ms]
    assert all(w.message_tokens_min <= n <= w.message_tokens_max for n in sizes)
    assert len(set(m for ms in plan.messages for m in ms)) == w.users * w.rounds
    assert build_plan(w, toy_encode) == plan
    assert build_plan(Workload(seed=1), toy_encode) != plan
    q = build_plan(QUICK, toy_encode)
    assert (len(q.messages), len(q.messages[0]), QUICK.answer_tokens) == (2, 3, 128)


@pytest.mark.parametrize("bad", ["bogus=3", "users=x", "users"])
def test_cli_rejects_bad_workload(bad: str) -> None:
    from launch.cli import cli

    res = CliRunner().invoke(cli, ["bench", "multi-turn", "--quick", "--workload", bad])
    assert res.exit_code == 2 and "FIELD=INT" in res.output
    res = CliRunner().invoke(cli, ["bench", "multi-turn", "--help"])
    assert res.exit_code == 0 and "answers-cached" in res.output


def test_write_renders_aggregated_repeats(tmp_path: Any) -> None:
    """JSON, plot and table from two repeats as bench.repeats aggregates them (a
    median of ints must still index the rounds)."""
    from bench import multi_turn_run
    from bench.repeats import _combined

    w = QUICK
    reps = [{**summarize(RECORDS), "provenance": _prov(float(i))} for i in range(2)]
    out = {"workload": dataclasses.asdict(w), "quick": True, "variants": {"answers-cached": _combined(reps)}}
    path = tmp_path / "mt.json"
    multi_turn_run._write(path, out)
    assert path.with_suffix(".png").exists() and "| answers-cached | 2 |" in path.with_suffix(".md").read_text()


def test_checks_stack_vllm() -> None:
    """Issue #26's budgets for our stack on vLLM: per request at most ideal + u in
    rounds >= 2, answer tokens hit >= 0.9, TTFT p50 within 10% of answers off."""
    u = 16
    cached = [rec(1, 1, 278, 0, ttft=50.0), rec(1, 2, 460, 400, ttft=30.0), rec(1, 3, 642, 576, ttft=30.0)]
    off = [rec(1, 1, 278, 0, ttft=50.0), rec(1, 2, 460, 272, ttft=28.0), rec(1, 3, 642, 448, ttft=28.0)]
    v = {"stack-vllm": _variant(cached), "stack-vllm-prompt-only": _variant(off, started=40.0)}
    out = checks(v, u)
    assert out["stack_vllm_ok"] and out["stack_vllm_over_bound"] == []
    assert out["stack_vllm_answer_hit_ratio"] == summarize(cached)["answer_tokens_hit_ratio"]
    assert out["stack_vllm_answer_hit_ok"] and out["stack_vllm_same_run"]
    assert out["stack_vllm_ttft_ratio"] == pytest.approx(30.0 / 28.0) and out["stack_vllm_ttft_ok"]
    slow = [dict(r, ttft_ms=r["ttft_ms"] * 1.2) for r in cached]
    assert not checks({**v, "stack-vllm": _variant(slow)}, u)["stack_vllm_ttft_ok"]
    assert "stack_vllm_ttft_below_vllm_pd" not in out
    # #25: against vLLM's own P/D, the cached share of the prompt above and the TTFT p50 below
    pd = [rec(1, 1, 278, 0, ttft=50.0), rec(1, 2, 460, 272, ttft=35.0), rec(1, 3, 642, 448, ttft=35.0)]
    out = checks({**v, "vllm-pd": _variant(pd)}, u)
    assert out["stack_vllm_cached_above_vllm_pd"] and out["stack_vllm_ttft_below_vllm_pd"]
    assert out["stack_vllm_ttft_p50_vs_vllm_pd"] == pytest.approx(30.0 / 35.0)
    fast = [dict(r, ttft_ms=20.0) for r in pd]
    assert not checks({**v, "vllm-pd": _variant(fast)}, u)["stack_vllm_ttft_below_vllm_pd"]
    over = [rec(1, 1, 278, 0), rec(1, 2, 460, 272), rec(1, 3, 642, 576)]  # round 2 recomputes the answer
    out = checks({**v, "stack-vllm": _variant(over)}, u)
    assert out["stack_vllm_over_bound"] == ["repeat 1: user1/round2"] and not out["stack_vllm_ok"]
    assert not out["stack_vllm_answer_hit_ok"]


def test_handoff_bytes_against_the_bound_of_the_new_tokens() -> None:
    """A whole handoff is N x kv + fixed; geometry is fitted from two prompts, and
    each rounds->=2 handoff is judged against (new tokens + u) x kv + fixed."""
    from bench.multi_turn import handoff_geometry

    kv, fixed, u = 1024, 5000, 16

    def whole(n: int) -> int:
        return n * kv + fixed

    def delta(n: int, prev: int) -> int:  # decode held the previous prompt's full blocks
        return (n - prev // u * u) * kv + fixed

    rows = [dict(r) for r in RECORDS]
    prev: dict[int, int] = {}
    for r in rows:
        n, p = r["prompt_tokens"], prev.get(r["user"])
        r["handoff_full_bytes"] = whole(n)
        r["handoff_bytes"] = whole(n) if p is None else delta(n, p)
        prev[r["user"]] = n
    assert handoff_geometry(rows) == (kv, fixed)
    out = summarize(rows, u)
    later = [r for r in out["requests"] if r["round"] >= 2]
    assert all(r["handoff_bytes"] <= r["handoff_bound_bytes"] for r in later)
    assert out["requests"][2]["handoff_bound_bytes"] == (460 - 278 + u) * kv + fixed
    assert out["handoff_bytes_per_request"] < out["handoff_full_bytes_per_request"]
    assert checks({"answers-cached": out}, u)["answers_cached_handoff_ok"]
    # a handoff that moved the whole prompt again breaks the bound, and the check says where
    rows[4]["handoff_bytes"] = whole(642)
    bad = checks({"answers-cached": summarize(rows, u)}, u)
    assert not bad["answers_cached_handoff_ok"] and bad["answers_cached_handoff_over_bound"][0].startswith(
        "repeat 1: user1/round3"
    )
    assert handoff_geometry(RECORDS) is None  # no handoff figures (vLLM, plain vLLM)


def test_an_answer_cut_inside_a_character_counts_the_ids_before_the_cut() -> None:
    """An answer that ends inside a character (``answer_kept_tokens`` below the
    completion): the router keeps the ids before the cut, so the next round's ideal
    and the protocol's hit count only those."""
    u = 16
    cut = [rec(1, 1, 278, 0, answer_kept_tokens=126), rec(1, 2, 458, 400), rec(1, 3, 640, 576)]
    rs = per_request(cut)
    assert [r["ideal_tokens"] for r in rs][1:] == [458 - 404, 640 - 586]
    assert [r["previous_answer_kept"] for r in rs][1:] == [126, 128]
    out = checks({"stack-vllm": _variant(cut)}, u)
    assert out["stack_vllm_ok"] and out["stack_vllm_over_bound"] == []
    # answers-cached: the protocol's hit is the tail of prompt + kept ids ((278 + 126 - 1) // 16 * 16)
    v = {"answers-cached": _variant(cut), "prompt-only": _variant(cut, started=40.0)}
    assert checks(v, u)["answers_cached_hit_not_predicted"] == []
    kept_none = [dict(cut[0], answer_kept_tokens=0), *cut[1:]]
    assert checks({"answers-cached": _variant(kept_none)}, u)["answers_cached_hit_not_predicted"] == [
        "repeat 1: user1/round2: cached 400, protocol 272"
    ]
    # prompt-only recomputes at least the kept answer besides the ideal
    po = [rec(1, 1, 278, 0, answer_kept_tokens=126), rec(1, 2, 458, 272), rec(1, 3, 640, 448)]
    assert checks({**v, "prompt-only": _variant(po, started=40.0)}, u)["prompt_only_recomputes_answer"]
    # records of a run before answer_kept_tokens was recorded are checked as whole answers
    old = {**v, "answers-cached": {**v["answers-cached"], "repeats": [_without_kept(v["answers-cached"])]}}
    assert checks(old, u)["answers_cached_hit_not_predicted"] == []  # protocol (278 + 128 - 1) // 16 * 16
    po_hit = [po[0], rec(1, 2, 458, 288), po[2]]
    assert not checks({**v, "prompt-only": _variant(po_hit, started=40.0)}, u)["prompt_only_recomputes_answer"]


def test_kept_tokens_by_the_router_s_tokenizer() -> None:
    """``kept_tokens`` on the bundled tokenizer agrees with the router's own rule
    (``IncrementalDetokenizer.received``) on whole answers and cut ones."""
    from bench.multi_turn_encoders import kept_tokens, native_encoders
    from hybridpd.model_files import TOKENIZER_DIR
    from hybridpd.tokenizer import IncrementalDetokenizer, TextTokenizer

    enc = native_encoders()
    assert enc.decode is not None
    tok = TextTokenizer(TOKENIZER_DIR)
    ids = enc.text_ids("ok \U0001f600")
    for gen in (ids, ids[:-1], ids[:-2], [*ids, *tok.stop_token_ids[:1]]):
        d = IncrementalDetokenizer(tok)
        d.push(gen, final=True)
        assert kept_tokens(gen, enc.decode, d.emitted) == d.received()
    assert kept_tokens(ids[:-1], enc.decode, "ok ") == len(enc.text_ids("ok "))


def _without_kept(variant: dict) -> dict:
    one = variant["repeats"][0]
    return {**one, "requests": [{k: x for k, x in r.items() if k != "previous_answer_kept"} for r in one["requests"]]}


def test_the_one_prefill_control_and_vllms_shipped_pd_are_variants() -> None:
    """#52: multi-turn has a 1-prefill control of stack-vllm, and vLLM's P/D as it ships."""
    from bench.multi_turn import Workload
    from bench.multi_turn_checks import _against_vllm_pd
    from bench.multi_turn_run import ORDER, variants

    args = variants(Workload())
    one, two = args["stack-vllm-1p1d"], args["stack-vllm"]
    assert one[one.index("--num-prefill") + 1] == "1" and two[two.index("--num-prefill") + 1] == "2"
    i = one.index("--num-prefill") + 1
    assert one[:i] + one[i + 1 :] == two[:i] + two[i + 1 :]  # nothing else differs
    assert {"stack-vllm-1p1d", "vllm-pd-shipped"} <= set(ORDER)
    v = {"ttft_p50_ms": 50.0, "cached_tokens_per_request": 8.0, "prompt_tokens_per_request": 10.0, "provenance": []}
    got = _against_vllm_pd(v, dict(v, ttft_p50_ms=100.0), "stack-vllm-1p1d", "vllm-pd-shipped")
    assert got["stack_vllm_1p1d_cached_share"] == 0.8 and got["vllm_pd_shipped_cached_share"] == 0.8
    assert got["stack_vllm_1p1d_ttft_p50_vs_vllm_pd_shipped"] == "not comparable"  # no provenance: no verdict
