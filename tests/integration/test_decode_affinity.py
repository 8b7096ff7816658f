"""Decode affinity: a conversation's next turn goes to the decode instance that
holds its previous turns, unless that one is overloaded; there its handoff
moves only the new blocks.

Real parts: a real Redis index, a native prefill engine, two real
``DecodeWorker`` s (native engines, NIXL agents in this process) whose cache
events their ``IndexMirror`` publishes, and the router's ``Dispatcher``
choosing between them (``routing.choose_decode``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, cast

import pytest

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from services.decode.actor import DecodeWorker
from services.router.dispatch import Dispatcher
from services.router.metrics import RouterMetrics
from services.worker.messages import PrefillResult
from tests.unit.engine_helpers import make_engine, prompt
from tests.wait import wait_until

pytestmark = pytest.mark.integration


def _req(rid: str, toks: tuple[int, ...]) -> EngineRequest:
    return EngineRequest(RequestId(rid), toks, SamplingParams(max_tokens=6, ignore_eos=True))


@pytest.fixture
def world(redis_server: RedisServer) -> Iterator[tuple[NativeEngine, dict[str, DecodeWorker]]]:
    tag = uuid.uuid4().hex[:6]
    prefill = make_engine(role="prefill", instance="p-aff-" + tag)
    names = ["decode-%s-0" % tag, "decode-%s-1" % tag]
    decoders = {
        n: DecodeWorker(prefill.cfg, n, redis_server.url, engine=make_engine(role="decode", instance=n)) for n in names
    }
    yield prefill, decoders
    for d in decoders.values():
        d.close()
    prefill.close()


def _turn(prefill: NativeEngine, decode: DecodeWorker, rid: str, toks: tuple[int, ...]) -> list[int]:
    r = _req(rid, toks)
    prefill.add_request(r, prefill_only=True)
    while prefill.has_work():
        prefill.step()
    ticket = prefill.pop_handoff(rid)
    assert ticket is not None
    pr = PrefillResult(rid, prefill.instance, (ticket.first_token_id,), None, len(toks), 0, 0, ticket)  # type: ignore[attr-defined]
    return [*pr.token_ids, *(t for c in decode.generate(pr, r) for t in c.token_ids)]


def test_the_next_turn_goes_to_the_holder_unless_it_is_overloaded(
    world: tuple[NativeEngine, dict[str, DecodeWorker]], redis_server: RedisServer
) -> None:
    prefill, decoders = world
    first, second = sorted(decoders)
    u = prefill.unit
    toks = prompt(150, 21)
    answer = _turn(prefill, decoders[first], "t1", toks)
    nxt = toks + tuple(answer) + prompt(30, 22)

    # the decode instance's cache events reach the index under its name; the route's one
    # lookup answers how much of the chain each decode instance holds
    index = PrefixIndex(redis_server.url, prefill.model_id)
    chain = prefill.hasher.chain(list(nxt))

    def held(c: list[Any]) -> Mapping[str, int]:
        return index.lookup(c, len(nxt), u, False, [first, second]).held

    wait_until(lambda: held(chain) == {first: 150 // u, second: 0}, 10, 0.02, "decode's blocks in the index")

    cfg = load_config(env={}, overrides={"decode_affinity_slack": 2})
    metrics = RouterMetrics()
    disp = Dispatcher(cfg, index, {}, cast("dict[str, Any]", dict.fromkeys(decoders)), metrics)
    hits = asyncio.run(disp._lookup(_req("t2", nxt), chain))
    assert hits.held == {first: 150 // u, second: 0}  # the Dispatcher asks for its decode instances

    def pick() -> str:
        return disp._pick_decode(None, hits.held)

    assert pick() == first  # the holder
    disp.decoding = {first: 2, second: 0}  # two more than the least busy: overloaded
    assert pick() == second
    disp.decoding = {first: 1, second: 0}
    assert pick() == first
    assert disp._pick_decode(None, held(prefill.hasher.chain(list(prompt(150, 23))))) in (first, second)  # none
    assert disp._pick_decode(first, hits.held) == second  # the one whose handoff failed is avoided
    got = {
        s.labels["decision"]: s.value
        for m in metrics.decode_routing.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert got == {"affinity": 2.0, "overloaded": 1.0, "round_robin": 2.0}

    # on the holder, the next turn's handoff reads only what it lacks
    before = decoders[first].stats()
    _turn(prefill, decoders[first], "t2", nxt)
    after = decoders[first].stats()
    assert cast(int, after["delta_handoffs"]) - cast(int, before["delta_handoffs"]) == 1
    skipped = cast(int, after["handoff_skipped_bytes"]) - cast(int, before["handoff_skipped_bytes"])
    per_token = 2 * len(prefill.model.attn_layers) * prefill.mcfg.num_kv_heads * prefill.mcfg.head_dim * 4
    assert skipped == (150 // u) * u * per_token
    assert 0 < cast(float, after["handoff_bytes_per_request"]) < cast(float, before["handoff_bytes_per_request"]) * 2
