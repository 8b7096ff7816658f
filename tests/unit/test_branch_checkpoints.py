"""Branch-aware checkpoints, router side (issue #16): where the extra positions
come from (junction, chat turns, client), how they merge, and why a prefix
missed (``hybridpd_prefix_tokens_total``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridpd.checkpoints import (
    MAX_REQUESTED_CHECKPOINTS,
    merge_requested,
)
from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import LookupResult
from hybridpd.models.bundled import resolve_model_dir
from hybridpd.prefix_outcomes import PREFIX_OUTCOMES, prefix_token_split
from hybridpd.tokenizer import ChatMessage, TextTokenizer
from hybridpd.validation import validate_checkpoints
from services.router.dispatch import Dispatcher, Route
from services.router.metrics import RouterMetrics
from services.router.routing import RouteDecision, SeenPrefixes
from tests.unit.fake_actors import clients

pytestmark = pytest.mark.unit

TOK = TextTokenizer(resolve_model_dir("tiny"))
SYSTEM = "You are the support assistant of a delta-rule company. Answer briefly."


# -- prefix_token_split --------------------------------------------------------------------
@given(
    n=st.integers(0, 2000),
    unit=st.sampled_from([1, 4, 16, 64]),
    eagle=st.booleans(),
    hit=st.integers(0, 2100),
    known=st.integers(0, 2100),
    seen=st.integers(0, 2100),
)
def test_prefix_split_partitions_the_prompt(n: int, unit: int, eagle: bool, hit: int, known: int, seen: int) -> None:
    split = prefix_token_split(n, unit, eagle, hit, known, seen)
    assert tuple(split) == PREFIX_OUTCOMES
    assert all(v >= 0 for v in split.values())
    assert sum(split.values()) == n
    full = max((n - 1) // unit * unit, 0) if n else 0
    cap = max(full - (unit if eagle else 0), 0)
    assert split["below_unit"] == n - full
    assert split["eagle_replay"] == full - cap  # a unit where EAGLE replays (less in a one-unit prompt)
    assert split["hit"] == min(hit, cap)


def test_prefix_split_names_each_reason() -> None:
    # no EAGLE, u=16, 200 tokens: a hit of 64, attention known to 128, routed before to 160
    assert prefix_token_split(200, 16, False, 64, 128, 160) == {
        "hit": 64,
        "checkpoint_missing": 64,
        "evicted": 32,
        "no_shared_prefix": 32,
        "eagle_replay": 0,
        "below_unit": 8,
    }
    # with EAGLE the replay unit is not a usable hit: known 128 allows 112
    assert prefix_token_split(200, 16, True, 64, 128, 128)["checkpoint_missing"] == 48


# -- merge_requested -----------------------------------------------------------------------
@given(
    n=st.integers(2, 5000),
    client=st.lists(st.integers(1, 4999), max_size=MAX_REQUESTED_CHECKPOINTS, unique=True),
    derived=st.lists(st.integers(-5, 6000), max_size=12),
)
def test_merged_positions_are_a_valid_request(n: int, client: list[int], derived: list[int]) -> None:
    client = sorted(p for p in client if p < n)
    merged = merge_requested(client, derived, n)
    validate_checkpoints(merged, n)  # what the engine accepts: ascending, inside, bounded
    inside = sorted({p for p in derived if 0 < p < n})
    assert set(inside[-MAX_REQUESTED_CHECKPOINTS:]) <= set(merged)  # derived positions first
    assert set(merged) <= set(client) | set(inside)


# -- SeenPrefixes ---------------------------------------------------------------------------
def test_seen_prefixes_finds_the_routed_run_and_stays_bounded() -> None:
    hasher = BlockHasher(unit=4, seed="seen")
    a = hasher.chain(list(range(100, 140)))  # 10 blocks
    b = hasher.chain(list(range(100, 124)) + [7] * 16)  # shares 6 blocks with a
    seen = SeenPrefixes(max_entries=100)
    assert seen.observe(a) == 0
    assert seen.observe(a) == 10
    assert seen.observe(b) == 6
    assert seen.observe(a[:3]) == 3
    assert len(seen) == 14
    small = SeenPrefixes(max_entries=12)
    small.observe(a)
    small.observe(b)
    assert len(small) == 12  # the oldest (a's first blocks) dropped first
    assert small.observe(a) == 0  # its head is gone: under-counted, never over-counted


# -- chat turns -----------------------------------------------------------------------------
def test_chat_boundaries_mark_what_conversations_share() -> None:
    one = [ChatMessage("system", SYSTEM), ChatMessage("user", "Where is my order?")]
    two = [ChatMessage("system", SYSTEM), ChatMessage("user", "How do I reset my password?")]
    p1 = TOK.chat_prompt(one)
    ids1, (b1,) = p1.ids, p1.boundaries
    p2 = TOK.chat_prompt(two)
    ids2, (b2,) = p2.ids, p2.boundaries
    assert ids1 == TOK.apply_chat_template(one) and ids2 == TOK.apply_chat_template(two)
    assert b1 == b2 and ids1[:b1] == ids2[:b2]  # the system prompt and the next turn's header
    shared = next(i for i, (x, y) in enumerate(zip(ids1, ids2, strict=False)) if x != y)
    assert b1 == shared  # nothing of the user's own text before the boundary
    assert TOK.decode(ids1[b1:]).startswith("Where is my order?")


def test_chat_boundaries_of_a_multi_turn_conversation() -> None:
    msgs = [
        ChatMessage("system", SYSTEM),
        ChatMessage("user", "What is the capital of France?"),
        ChatMessage("assistant", "Paris."),
        ChatMessage("user", "And of Spain?"),
    ]
    p = TOK.chat_prompt(msgs)
    ids, turns = p.ids, p.boundaries
    assert len(turns) == 2
    first, last = turns
    assert TOK.decode(ids[first:]).startswith("What is the capital")
    assert TOK.decode(ids[last:]).startswith("And of Spain?")
    # an edited last question shares everything before the last boundary
    edited = [*msgs[:3], ChatMessage("user", "Which river runs through it?")]
    p2 = TOK.chat_prompt(edited)
    ids2, turns2 = p2.ids, p2.boundaries
    assert turns2[-1] == last and ids2[:last] == ids[:last]


def test_chat_without_a_system_prompt_or_history_has_no_boundary() -> None:
    assert TOK.chat_prompt([ChatMessage("user", "hello")]).boundaries == ()
    assert TOK.chat_prompt([ChatMessage("system", SYSTEM)]).boundaries == ()


# -- the junction the router adds -------------------------------------------------------------
def _dispatcher(**cfg: Any) -> Dispatcher:
    pre, dec = clients({"p": object()}, [object()])  # never called: routing and placement only
    return Dispatcher(load_config(env={}, overrides=cfg), None, pre, dec, RouterMetrics())


def _route(hit: int, known: int) -> Route:
    return Route(RouteDecision("p", hit, 0, hit, "local_hit"), [], known, True)


def test_branch_aware_router_adds_the_junction_past_the_hit() -> None:
    req = EngineRequest(RequestId("r"), tuple(range(3, 303)), SamplingParams(), None, (40,))
    d = _dispatcher(checkpoint_placement="off")
    assert d.with_junction(req, _route(64, 240)).checkpoints == (40, 240)
    assert d.with_junction(req, _route(64, 64)) is req  # nothing known past the hit
    assert d.with_junction(req, _route(0, 300)) is req  # the whole prompt: no junction inside it
    tail_only = _dispatcher(checkpoint_policy="tail-only", checkpoint_placement="off")
    assert tail_only.with_junction(req, _route(64, 240)) is req


def test_on_vllm_boundaries_and_junctions_are_staged_only_a_step_s_worth_past_the_hit() -> None:
    """On vLLM each router-chosen checkpoint is a staged prefix: an engine step for this
    request. The chat boundaries (``Built.boundaries``) and the junction are staged only
    ``vllm_stage_gap_tokens`` (128) past the hit or the one kept before them: the end
    of a 300-token system prompt is, a turn 40 tokens past a cached conversation is not,
    nor a junction 60 tokens past the hit. 0 stages them all; native merges them all."""
    req = EngineRequest(RequestId("r"), tuple(range(3, 1003)), SamplingParams(), None, (40,))
    vllm = _dispatcher(engine="vllm", checkpoint_placement="off")
    # a new conversation: the system prompt's end (300) and the last turn (337), nothing cached
    assert vllm.with_junction(req, _route(0, 0), (300, 337)).checkpoints == (40, 300)
    # the next turn of a cached conversation: its last user turn starts 40 tokens past the hit
    assert vllm.with_junction(req, _route(896, 896), (300, 936)) is req
    # a branch 60 tokens past the hit: its junction is not worth a step; 200 past it is
    assert vllm.with_junction(req, _route(640, 700)) is req
    assert vllm.with_junction(req, _route(640, 840)).checkpoints == (40, 840)
    every = _dispatcher(engine="vllm", checkpoint_placement="off", vllm_stage_gap_tokens=0)
    assert every.with_junction(req, _route(896, 896), (300, 936)).checkpoints == (40, 300, 936)
    native = _dispatcher(checkpoint_placement="off")
    assert native.with_junction(req, _route(640, 700)).checkpoints == (40, 700)


def test_router_places_checkpoints_past_the_hit_besides_the_junction() -> None:
    """The default placement adds positions the engine can write: unit multiples past
    the hit, below the tail, none of them the junction; off adds none; the vLLM engine
    (which stages each as a prefix) gets unit multiples too; the divergences the router
    saw pull them towards the tail."""
    req = EngineRequest(RequestId("r"), tuple(range(3, 1003)), SamplingParams())
    d = _dispatcher()
    out = d.with_junction(req, _route(64, 64))
    assert out.checkpoints == () and 1 <= len(out.placement) <= 2
    assert all(64 < p < 992 and p % 16 == 0 for p in out.placement)
    for _ in range(50):  # prompts that left a known prefix 30 tokens before their end
        d.divergence.observe(1000, 970, 16)
    deep = d.with_junction(req, _route(64, 64)).placement
    assert max(deep) == 960 and max(deep) > max(out.placement)  # the deepest state below 970
    assert _dispatcher(checkpoint_placement="off").with_junction(req, _route(64, 64)) is req
    assert _dispatcher(engine="vllm", vllm_placement=False).with_junction(req, _route(64, 64)) is req
    on_vllm = _dispatcher(engine="vllm").with_junction(req, _route(64, 64)).placement  # vllm_placement: default on
    assert 1 <= len(on_vllm) <= 2 and all(64 < p < 992 and p % 16 == 0 for p in on_vllm)


def test_placement_on_a_stream_that_shares_nothing_stops_sooner_on_vllm() -> None:
    """Random prompts (nothing known): on vLLM, where each placed checkpoint is a
    staged prefix, the router places only while one later sharer is expected
    (``followers >= 1``: the first prompt, half of those seen shared); with a step
    cost (``vllm_stage_tokens``) too; native (no step) places on. A prompt that
    shares a known prefix itself is placed on vLLM after any stream."""
    req = EngineRequest(RequestId("r"), tuple(range(3, 1028)), SamplingParams())

    def placed(d: Dispatcher, known: int = 0, times: int = 30) -> list[int]:
        return [len(d.with_junction(req, _route(0, known)).placement) for _ in range(times)]

    native, stepped = placed(_dispatcher()), placed(_dispatcher(engine="vllm", vllm_stage_tokens=128))
    vllm = _dispatcher(engine="vllm")
    assert native == [2] * 30 and placed(vllm) == [2] + [0] * 29  # one sharer expected only at first
    assert stepped[0] == 1 and sum(stepped) == 1
    assert placed(vllm, known=512, times=1) == [1]  # shares 512 tokens (its junction too): its family goes on
    assert vllm.divergence.followers() < 1.0 <= vllm.divergence.followers(shares=True)


class _Index:
    """The prefix index as the router's lookup calls it: records the EAGLE drop asked for."""

    def __init__(self) -> None:
        self.drops: list[bool] = []

    def lookup(
        self, hashes: Sequence[bytes], num_tokens: int, unit: int, eagle: bool, held_by: Sequence[str] = ()
    ) -> LookupResult:
        self.drops.append(eagle)
        return LookupResult(0, {"p": 0}, 0)


def test_on_vllm_with_eagle_the_router_predicts_the_prefill_engine_s_plain_hits() -> None:
    """A vLLM P/D prefill engine runs no drafter (``args.speculative_config`` is None
    for role prefill; ``VllmEngine.drop_eagle_block`` reads vLLM's scheduler), so its
    hits, its tail and its staged prefixes are the plain ones: with ``eagle`` on (a
    drafter on decode) the router looks up, remembers and places exactly as without
    (``EngineProfile.eagle_drop_prefill``)."""
    req = EngineRequest(RequestId("r"), tuple(range(3, 1028)), SamplingParams(), None, (100, 500))
    got = []
    for eagle in (False, True):
        d = _dispatcher(engine="vllm", eagle=eagle)
        d.index = _Index()  # type: ignore[assignment]
        asyncio.run(d.route(req))
        assert d.index.drops == [False] and not d.recent.eagle  # type: ignore[attr-defined]
        preq = d.with_junction(req, _route(64, 64))
        got.append((preq.checkpoints, preq.placement))
    assert got[0] == got[1] and got[0][1]
