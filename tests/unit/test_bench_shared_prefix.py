"""The shared-prefix benchmark's plan and arithmetic (bench/shared_prefix.py), without a stack."""

from __future__ import annotations

import math
from typing import Any

from bench.shared_prefix import (
    QUICK,
    Messages,
    PlannedRequest,
    Workload,
    build_plan,
    ideal_tokens,
    lcp,
    summarize,
)

ROLE_IDS = {"system": 1, "user": 2, "assistant": 3}


def toy_encode(msgs: Messages) -> list[int]:
    """A chat template in miniature: role id, one id per word, end id; then the generation prompt."""
    out: list[int] = []
    for role, content in msgs:
        out += [ROLE_IDS[role], *(5 + sum(map(ord, w)) % 2000 for w in content.split()), 4]
    return [*out, ROLE_IDS["assistant"]]


def test_lcp_and_ideal_exact() -> None:
    assert lcp([1, 2, 3], [1, 2, 4]) == 2
    assert lcp([1, 2], [1, 2, 3]) == 2
    assert lcp([], [1]) == 0
    a = list(range(100))
    prompts = [
        a,  # nothing earlier: 0
        a[:40] + [-1] * 30,  # shares 40 with a: 32
        a[:40] + [-1] * 10 + [7],  # shares 50 with the previous: 48
        [*a, 5],  # a is a whole prefix (100): 96
        a[:33],  # shares all 33 with a, capped at 32 (one token computed): 32
        a[:32],  # all 32 shared, capped at 31: 16
        [9] * 20,  # nothing: 0
    ]
    assert ideal_tokens(prompts, 16) == [0, 32, 48, 96, 32, 16, 0]
    assert ideal_tokens(prompts, 1) == [0, 40, 50, 100, 32, 31, 0]


def _by_phase(plan: list[PlannedRequest]) -> dict[str, list[PlannedRequest]]:
    out: dict[str, list[PlannedRequest]] = {}
    for r in plan:
        out.setdefault(r.phase, []).append(r)
    return out


def test_plan_shape_and_counting() -> None:
    w = Workload()
    plan = build_plan(w, toy_encode)
    phases = _by_phase(plan)
    names = ("fanout", "tree", "multiturn", "twosharer")
    assert list(phases) == ["%s_%s" % (p, k) for k in ("ids", "chat") for p in names]
    for kind in ("ids", "chat"):
        assert len(phases["fanout_" + kind]) == w.conversations
        assert len(phases["tree_" + kind]) == 1 + w.forks + w.forks**2
        assert len(phases["multiturn_" + kind]) == w.turn_conversations * w.turns
        assert [r.counted for r in phases["twosharer_" + kind]] == [False, True] * w.pairs
    assert [r.label for r in phases["tree_ids"]][:5] == ["trunk", "fork1", "fork2", "fork3", "fork1.1"]
    assert phases["multiturn_chat"][-1].label == "conv4/turn5"
    # fan-out counts conversations 3..N with token ids, 2..N with chat; the rest counts everything
    assert [r.counted for r in phases["fanout_ids"]] == [False, False] + [True] * (w.conversations - 2)
    assert [r.counted for r in phases["fanout_chat"]] == [False] + [True] * (w.conversations - 1)
    assert all(r.counted for p in ("tree", "multiturn") for k in ("ids", "chat") for r in phases["%s_%s" % (p, k)])
    assert all(not r.chat for r in plan[: len(plan) // 2]) and all(r.chat for r in plan[len(plan) // 2 :])
    # pure: the same workload gives the same plan
    assert build_plan(w, toy_encode) == plan
    assert build_plan(Workload(seed=1), toy_encode) != plan


def test_plan_prompts_are_off_unit_and_share_as_designed() -> None:
    w = Workload()
    plan = build_plan(w, toy_encode)
    prompts = [toy_encode(r.messages) if r.chat else list(r.tokens) for r in plan]
    assert all(len(p) % w.unit for p in prompts)
    assert all(5 <= t < 2048 for r in plan for t in r.tokens)
    ideal = dict(zip(((r.phase, r.label) for r in plan), ideal_tokens(prompts, w.unit), strict=True))
    ids = {(r.phase, r.label): r.tokens for r in plan if not r.chat}
    fan = [ids["fanout_ids", "conv%d" % i] for i in range(1, w.conversations + 1)]
    system = lcp(fan[0], fan[1])
    assert system >= w.system_tokens and system % w.unit  # the shared system prompt is not a unit multiple
    assert ideal["fanout_ids", "conv1"] == 0
    assert all(ideal["fanout_ids", "conv%d" % i] == system // w.unit * w.unit for i in range(2, 5))
    # the tree: a fork's prefix is its parent's prompt + the parent's answer, shared by its siblings
    trunk, f1, f2 = ids["tree_ids", "trunk"], ids["tree_ids", "fork1"], ids["tree_ids", "fork2"]
    assert f1[: len(trunk)] == trunk and lcp(f1, f2) == len(trunk) + w.tree_answer_tokens
    assert ideal["tree_ids", "fork1"] == len(trunk) // w.unit * w.unit
    assert ideal["tree_ids", "fork2"] == (len(trunk) + w.tree_answer_tokens) // w.unit * w.unit
    f11, f12 = ids["tree_ids", "fork1.1"], ids["tree_ids", "fork1.2"]
    assert f11[: len(f1)] == f1 and lcp(f11, f12) == len(f1) + w.tree_answer_tokens
    assert ideal["tree_ids", "fork1.1"] == len(f1) // w.unit * w.unit
    # multi-turn continues the first conversations of fan-out: each turn extends the one before
    t2, t3 = ids["multiturn_ids", "conv2/turn2"], ids["multiturn_ids", "conv2/turn3"]
    assert t2[: len(fan[1])] == fan[1] and t3[: len(t2)] == t2
    assert len(t3) - len(t2) >= 2 * w.turn_tokens
    assert ideal["multiturn_ids", "conv2/turn3"] == len(t2) // w.unit * w.unit
    # two-sharer: a pair shares header + its document (of its own length), pairs only the header
    pair = [(ids["twosharer_ids", "pair%d%s" % (j, s)]) for j in (1, 2) for s in "ab"]
    header, doc1, doc2 = lcp(pair[0], pair[2]), lcp(pair[0], pair[1]), lcp(pair[2], pair[3])
    assert w.header_tokens <= header < w.header_tokens + w.unit
    assert w.doc_min_tokens <= doc1 - header <= w.doc_max_tokens and doc1 - header != doc2 - header
    assert ideal["twosharer_ids", "pair1b"] == doc1 // w.unit * w.unit
    assert ideal["twosharer_ids", "pair2a"] == header // w.unit * w.unit
    # chat: the same structure in messages
    chat = {(r.phase, r.label): r.messages for r in plan if r.chat}
    c1, c2 = chat["fanout_chat", "conv1"], chat["fanout_chat", "conv2"]
    assert c1[0] == c2[0] and c1[0][0] == "system" and c1[1][0] == c2[1][0] == "user" and len(c1) == 2
    assert lcp(toy_encode(c1), toy_encode(c2)) % w.unit
    f1c, f2c = chat["tree_chat", "fork1"], chat["tree_chat", "fork2"]
    assert f1c[:-1] == f2c[:-1] and [r for r, _ in f1c] == ["system", "user", "assistant", "user"]
    turn3 = chat["multiturn_chat", "conv1/turn3"]
    assert turn3[:-2] == chat["multiturn_chat", "conv1/turn2"] and [r for r, _ in turn3[-2:]] == ["assistant", "user"]


def test_quick_plan_is_small() -> None:
    plan = build_plan(QUICK, toy_encode)
    per_kind = QUICK.conversations + 1 + QUICK.forks + QUICK.forks**2 + QUICK.turn_conversations * 2 + 2 * QUICK.pairs
    assert len(plan) == 2 * per_kind


def _rec(phase: str, label: str, counted: bool, cached: int, ideal: int, ttft: float, **kw: object) -> dict[str, Any]:
    return {
        "phase": phase,
        "label": label,
        "counted": counted,
        "cached_tokens": cached,
        "ideal_tokens": ideal,
        "prompt_tokens": ideal + 10,
        "ttft_ms": ttft,
        **kw,
    }


def test_summarize_exact() -> None:
    records = [
        _rec("fanout_ids", "conv1", False, 0, 0, 500.0, tail_checkpoint=160),
        _rec("fanout_ids", "conv2", False, 0, 288, 100.0, tail_checkpoint=320),
        _rec("fanout_ids", "conv3", True, 288, 288, 30.0, tail_checkpoint=None),
        _rec("fanout_ids", "conv4", True, 272, 288, 20.0, tail_checkpoint=None),
        _rec("tree_ids", "trunk", True, 0, 0, 50.0, tail_checkpoint=192),
        _rec("tree_ids", "fork1", True, 192, 192, 40.0, tail_checkpoint=304),
    ]
    out = summarize(records, {"fanout_ids": 56_000, "tree_ids": 0})
    f = out["fanout_ids"]
    assert f["counted"] == ["conv3", "conv4"]
    assert (f["cached_tokens"], f["ideal_tokens"]) == (560, 576)
    assert f["hit_ratio"] == 560 / 576
    assert (f["cached_tokens_all"], f["ideal_tokens_all"]) == (560, 864)
    assert f["hit_ratio_all"] == 560 / 864
    assert f["requests"] == 4 and f["prompt_tokens"] == 864 + 40
    assert f["ttft_p50_ms"] == 65.0  # median of 20, 30, 100, 500
    assert f["ttft_p90_ms"] == 500.0
    assert f["state_bytes"] == 56_000 and f["state_bytes_per_cached_token"] == 100.0
    assert f["tails_forbidden"] == ["conv3", "conv4"]
    assert f["prefix_tokens"] is None  # no request had the router's split
    a = _rec("x", "a", True, 0, 16, 1.0, prefix_tokens={"hit": 0, "checkpoint_missing": 16})
    b = _rec("x", "b", True, 32, 48, 1.0, prefix_tokens={"hit": 32, "evicted": 16})
    assert summarize([a, b], None)["x"]["prefix_tokens"] == {"hit": 32, "checkpoint_missing": 16, "evicted": 16}
    t = out["tree_ids"]
    assert t["hit_ratio"] == t["hit_ratio_all"] == 1.0 and t["tails_forbidden"] == []
    assert t["state_bytes_per_cached_token"] == 0.0
    # no counter (vllm-direct), no tail annotation, nothing to hit
    bare = summarize([{k: v for k, v in r.items() if k != "tail_checkpoint"} for r in records[:2]], None)
    b = bare["fanout_ids"]
    assert b["state_bytes"] is None and b["state_bytes_per_cached_token"] is None and b["tails_forbidden"] is None
    assert b["counted"] == [] and math.isnan(b["hit_ratio"]) and b["hit_ratio_all"] == 0.0


#: one machine (bench.provenance.same_run compares only records that name theirs)
MACHINE = {"cpu": "Test CPU", "cpu_flags": ["avx2"], "machine_id": "m0"}
#: a record every variant of a test shares: one clean commit, one machine, one sitting
ONE_RUN = {"commit": "c0", "dirty": False, "started": 0.0, "ended": 60.0, "machine": MACHINE}


def test_checks_stack_vllm_against_vllm() -> None:
    """Issue #26: stack-vllm >= 0.9 of the ideal on every phase and above vllm-direct
    and vllm-pd on each, from one run (the provenance's times and commit)."""
    from bench.shared_prefix_checks import checks

    def variant(ratios: dict[str, float], started: float, commit: str = "c0") -> dict:
        prov = {"commit": commit, "dirty": False, "started": started, "ended": started + 60.0, "machine": MACHINE}
        phases = {p: {"hit_ratio": r, "ttft_p50_ms": 50.0} for p, r in ratios.items()}
        return {"phases": phases, "prompt_tokens_match": True, "provenance": [prov]}

    ours = variant({"fanout_ids": 1.0, "tree_ids": 0.95}, 0.0)
    direct = variant({"fanout_ids": 0.0, "tree_ids": 0.83}, 70.0)
    pd = variant({"fanout_ids": 0.0, "tree_ids": 0.78}, 140.0)
    out = checks({"stack-vllm": ours, "vllm-direct": direct, "vllm-pd": pd})
    assert out["stack_vllm_ok"] and out["stack_vllm_above_vllm"] and out["stack_vllm_same_run"]
    assert out["stack_vllm_below"] == [] and out["stack_vllm_not_above"] == []
    tied = variant({"fanout_ids": 0.0, "tree_ids": 0.95}, 140.0)
    out = checks({"stack-vllm": ours, "vllm-direct": direct, "vllm-pd": tied})
    assert not out["stack_vllm_above_vllm"] and out["stack_vllm_not_above"] == ["tree_ids: 0.950 vs vllm-pd 0.950"]
    assert not out["stack_vllm_above_vllm_or_ideal"]
    ideal = variant({"fanout_ids": 1.0, "tree_ids": 1.0}, 0.0)
    at_ideal = variant({"fanout_ids": 0.0, "tree_ids": 1.0}, 70.0)
    out = checks({"stack-vllm": ideal, "vllm-direct": at_ideal, "vllm-pd": pd})
    assert not out["stack_vllm_above_vllm"] and out["stack_vllm_not_above"] == ["tree_ids: 1.000 vs vllm-direct 1.000"]
    assert out["stack_vllm_above_vllm_or_ideal"] and out["stack_vllm_not_above_or_ideal"] == []
    low = variant({"fanout_ids": 1.0, "tree_ids": 0.88}, 0.0)
    out = checks({"stack-vllm": low, "vllm-direct": direct, "vllm-pd": pd})
    assert not out["stack_vllm_ok"] and out["stack_vllm_below"] == ["tree_ids"] and out["stack_vllm_above_vllm"]
    later = variant({"fanout_ids": 0.0, "tree_ids": 0.78}, 140.0, commit="c1")
    assert not checks({"stack-vllm": ours, "vllm-direct": direct, "vllm-pd": later})["stack_vllm_same_run"]


def test_ttft_checks_against_vllm_pd() -> None:
    """Issue #25: stack-vllm's and stack-vllm-1p1d's TTFT p50 per phase against
    vllm-pd's, with the phases where ours is not below (a tie is not below)."""
    from bench.shared_prefix_checks import checks

    def variant(ttfts: dict[str, float]) -> dict:
        phases = {p: {"hit_ratio": 1.0, "ttft_p50_ms": t} for p, t in ttfts.items()}
        return {"phases": phases, "prompt_tokens_match": True, "provenance": [ONE_RUN]}

    pd = variant({"fanout_ids": 80.0, "tree_ids": 60.0})
    out = checks({"stack-vllm": variant({"fanout_ids": 40.0, "tree_ids": 60.0}), "vllm-pd": pd})
    assert out["stack_vllm_ttft_p50_vs_vllm_pd"] == {"fanout_ids": 0.5, "tree_ids": 1.0}
    assert out["stack_vllm_ttft_not_below_vllm_pd"] == ["tree_ids"] and not out["stack_vllm_ttft_below_vllm_pd"]
    assert "stack_vllm_1p1d_ttft_below_vllm_pd" not in out
    one = variant({"fanout_ids": 79.0, "tree_ids": 59.9})
    out = checks({"stack-vllm": variant({"fanout_ids": 90.0, "tree_ids": 61.0}), "stack-vllm-1p1d": one, "vllm-pd": pd})
    assert out["stack_vllm_1p1d_ttft_below_vllm_pd"] and out["stack_vllm_1p1d_ttft_not_below_vllm_pd"] == []
    assert out["stack_vllm_ttft_not_below_vllm_pd"] == ["fanout_ids", "tree_ids"]


def test_the_tail_stage_trade_against_vllm_pd() -> None:
    """stack-vllm-no-tail-stage gets the same checks, and every stack the phases
    where it caches no more than vllm-pd (a tie is not above): the tail stage's
    trade, a unit of hit against an engine step, in one JSON."""
    from bench.shared_prefix_checks import checks

    def variant(ttft: dict[str, float], cached: dict[str, int]) -> dict:
        phases = {p: {"hit_ratio": 1.0, "ttft_p50_ms": t, "cached_tokens": cached[p]} for p, t in ttft.items()}
        return {"phases": phases, "prompt_tokens_match": True, "provenance": [ONE_RUN]}

    pd = variant({"multiturn_ids": 90.0, "tree_ids": 60.0}, {"multiturn_ids": 784, "tree_ids": 100})
    ours = variant({"multiturn_ids": 95.0, "tree_ids": 50.0}, {"multiturn_ids": 800, "tree_ids": 200})
    no_tail = variant({"multiturn_ids": 80.0, "tree_ids": 50.0}, {"multiturn_ids": 784, "tree_ids": 200})
    out = checks({"stack-vllm": ours, "stack-vllm-no-tail-stage": no_tail, "vllm-pd": pd})
    assert out["stack_vllm_cached_not_above_vllm_pd"] == [] and out["stack_vllm_ttft_not_below_vllm_pd"] == [
        "multiturn_ids"
    ]
    assert out["stack_vllm_no_tail_stage_cached_not_above_vllm_pd"] == ["multiturn_ids"]
    assert out["stack_vllm_no_tail_stage_ttft_below_vllm_pd"]


def test_plan_ttft_p50_against_vllm_pd() -> None:
    """Issue #25 on the whole workload: the TTFT p50 over every request of the plan
    (median over repeats), ours against vllm-pd's; a tie is not below."""
    from bench.shared_prefix_checks import checks, plan_ttft_p50

    def variant(*repeats: list[float]) -> dict:
        reps = [{"requests": [{"ttft_ms": t} for t in ttfts]} for ttfts in repeats]
        phases = {"fanout_ids": {"hit_ratio": 1.0, "ttft_p50_ms": 1.0}}
        return {"phases": phases, "repeats": reps, "prompt_tokens_match": True, "provenance": [ONE_RUN]}

    pd = variant([70.0, 80.0, 200.0], [60.0, 90.0, 95.0], [10.0, 85.0, 300.0])  # p50s 80, 90, 85
    assert plan_ttft_p50(pd) == 85.0
    assert plan_ttft_p50({"requests": [{"ttft_ms": 5.0}, {"ttft_ms": 7.0}]}) == 6.0  # one run: its own
    assert plan_ttft_p50({"phases": {}}) is None
    ours = variant([40.0, 84.0, 500.0], [84.0, 84.0, 1.0], [99.0, 100.0, 1.0])  # p50s 84, 84, 99
    out = checks({"stack-vllm": ours, "stack-vllm-1p1d": variant([85.0]), "vllm-pd": pd})
    assert (
        out["stack_vllm_plan_ttft_p50_vs_vllm_pd"] == round(84.0 / 85.0, 3)
        and out["stack_vllm_plan_ttft_below_vllm_pd"]
    )
    assert out["stack_vllm_1p1d_plan_ttft_p50_vs_vllm_pd"] == 1.0 and not out["stack_vllm_1p1d_plan_ttft_below_vllm_pd"]
