"""The router's policy under concurrency, without timing: the real
``Orchestrator`` and a real Redis index, in front of fake prefill instances
whose prefills finish only when the test lets them (every request of a round
is dispatched while all are still in flight) and whose publication lag the
test chooses.

The fakes follow the native engine's cache rules (``longest_usable_hit`` for
the hit, ``planned_checkpoint`` for the state a prefill leaves) and report
``num_cached_tokens`` like it, so the growing-streams figures come out of the
same definitions as the benchmark's.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import pytest

from hybridpd.checkpoints import checkpoint_position, longest_usable_hit, planned_checkpoint
from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from services.router.metrics import RouterMetrics
from services.router.orchestrator import Orchestrator
from services.worker.messages import PrefillCommand, PrefillResult
from tests.unit.fake_actors import clients

NAMES = ["prefill-0", "prefill-1"]


class _Tokenizer:
    vocab_size = 4096

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return asyncio.ensure_future(self.fn(*args))


class FakePrefill:
    """A prefill instance: a local cache of KV blocks and state checkpoints (by chain
    hash), published in the index by :class:`World`."""

    def __init__(self, name: str, index: PrefixIndex, orch_cfg: Any, world: World) -> None:
        self.name, self.index, self.cfg, self.world = name, index, orch_cfg, world
        self.kv: set[bytes] = set()
        self.st: set[bytes] = set()
        self.prefill = _Method(self._prefill)
        self.abort = _Method(self._abort)

    async def _abort(self, rid: str) -> bool:
        return False

    async def _prefill(self, cmd: PrefillCommand) -> PrefillResult:
        req = cmd.request
        u = self.cfg.prefix_match_unit
        n = len(req.prompt_token_ids)
        hashes = self.world.hasher.chain(req.prompt_token_ids)
        lead = 0
        while lead < len(hashes) and hashes[lead] in self.kv:
            lead += 1
        states = {(i + 1) * u for i in range(lead) if hashes[i] in self.st}
        hit = longest_usable_hit(n, u, lead, states, False)
        self.world.in_flight += 1
        await self.world.gate.wait()  # the test opens the gate once the whole round is dispatched
        self.world.in_flight -= 1
        self.kv.update(hashes)
        cp = planned_checkpoint(hit, n, n, u, self.cfg.mamba_block_size, self.cfg.checkpoint_alignment, False)
        sts = [hashes[cp // u - 1]] if cp else []
        self.st.update(sts)
        self.world.publish(self, hashes, sts)
        return PrefillResult(RequestId(req.request_id), self.name, (7,), "length", n, hit, 0)


class World:
    """The rounds, the gate, and index publication ``lag`` rounds late: a prefill of
    round r is published when round r + lag starts (0: at once, before the prefill
    returns, as the native engine does; 1: before the next round is routed; 2: after)."""

    def __init__(self, index: PrefixIndex, lag: int) -> None:
        self.index, self.lag = index, lag
        self.hasher: Any = None
        self.gate = asyncio.Event()
        self.in_flight = 0
        self.round = 0
        self.queue: list[tuple[int, FakePrefill, list[bytes], list[bytes]]] = []

    def publish(self, inst: FakePrefill, kv: list[bytes], st: list[bytes]) -> None:
        self.queue.append((self.round + self.lag, inst, kv, st))
        self.flush()

    def flush(self) -> None:
        keep = []
        for due, inst, kv, st in self.queue:
            if due <= self.round:
                self.index.publish_local(inst.name, kv, st)
            else:
                keep.append((due, inst, kv, st))
        self.queue = keep


def _setup(url: str, lag: int, routers: int = 1) -> tuple[list[Orchestrator], World]:
    cfg = load_config(env={}, overrides={"max_model_len": 16384})
    index = PrefixIndex(url, "m-" + uuid.uuid4().hex[:8])
    world = World(index, lag)
    for name in NAMES:
        index.heartbeat(name)
    world.hasher = BlockHasher(unit=cfg.prefix_match_unit, algo=cfg.hash_algo, seed=cfg.hash_seed)
    shared, _ = clients({name: FakePrefill(name, index, cfg, world) for name in NAMES})
    orchs = [
        Orchestrator(cfg, _Tokenizer(), "m", index, shared, {}, RouterMetrics())  # type: ignore[arg-type]
        for _ in range(routers)
    ]
    assert orchs[0].dispatch.hasher == world.hasher  # the fakes hash as the router does
    return orchs, world


async def _one(orch: Orchestrator, tokens: list[int], rid: str) -> int:
    req = EngineRequest(RequestId(rid), tuple(tokens), SamplingParams(max_tokens=1))
    cached = -1
    async for ev in orch.stream(req, "test"):
        if ev.usage is not None:
            cached = ev.usage.cached_tokens
    return cached


async def _growing(orchs: list[Orchestrator], world: World, streams: int, lengths: list[int]) -> list[tuple[int, int]]:
    """(prompt, cached) of every incremental request; every round fully in flight."""
    rng = random.Random(streams)
    toks = [[rng.randrange(5, 2048) for _ in range(lengths[-1])] for _ in range(streams)]
    out = []
    for r, n in enumerate(lengths):
        world.round = r
        world.flush()
        world.gate.clear()
        tasks = [
            asyncio.create_task(_one(orchs[(r + s) % len(orchs)], toks[s][:n], "r%d-s%d" % (r, s)))
            for s in range(streams)
        ]
        while world.in_flight < streams:  # all dispatched, none finished
            await asyncio.sleep(0.005)
        world.gate.set()
        got = await asyncio.gather(*tasks)
        if r > 0:
            out.extend((n, c) for c in got)
    return out


def _recompute_over_ideal(reqs: list[tuple[int, int]], step: int) -> float:
    return sum(n - c for n, c in reqs) / len(reqs) / step


LENGTHS = list(range(2000, 2801, 200))  # growing-streams --quick
FLOOR = sum(200 + n - checkpoint_position(n, 16, False) for n in LENGTHS[:-1]) / (len(LENGTHS) - 1) / 200


@pytest.mark.parametrize("lag", [0, 2])
def test_streams_in_flight_keep_their_hits(redis_server: RedisServer, lag: int) -> None:
    """8 streams all in flight each round; the index hears of a prefill before it
    returns (lag 0, the native engine) or only after the next round was routed
    (lag 2: the router's own memory of its prefills must carry the hit). The store
    is never published (its publisher lags indefinitely). Every request hits the
    previous round's checkpoint: recompute = the policy's floor, within
    growing-streams' bound."""
    orchs, world = _setup(redis_server.url, lag)
    reqs = asyncio.run(_growing(orchs, world, 8, LENGTHS))
    assert len(reqs) == 8 * (len(LENGTHS) - 1)
    assert all(c == checkpoint_position(n - 200, 16, False) for n, c in reqs), reqs
    assert _recompute_over_ideal(reqs, 200) == pytest.approx(FLOOR) and FLOOR <= 1.1
    # the load stayed spread: both instances hold streams
    assert all(client.handle.kv for client in orchs[0].prefill.values())


def test_two_routers_on_one_index_hit_as_much_as_one(redis_server: RedisServer) -> None:
    """Requests alternate between two routers; the prefill publishes before it
    returns, so the index alone carries every hit from one router to the other."""
    one = asyncio.run(_growing(*_setup(redis_server.url, 0, routers=1), 6, LENGTHS))
    two = asyncio.run(_growing(*_setup(redis_server.url, 0, routers=2), 6, LENGTHS))
    assert sum(c for _, c in two) == sum(c for _, c in one)
    assert _recompute_over_ideal(two, 200) == pytest.approx(FLOOR)
