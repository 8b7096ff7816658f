"""vLLM's KV events, mirrored into the Redis prefix index, predict vLLM's own
prefix hits: after an engine served a prompt, the index lookup for a grown
prompt equals the cached tokens vLLM reports when it serves that grown prompt
(real redis-server, vLLM's real ZMQ publisher, our subscriber)."""

from __future__ import annotations

import multiprocessing as mp
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from hybridpd.config import load_config
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from tests.vllm.workers import events_worker

CTX = mp.get_context("spawn")


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 2048) for _ in range(n)]


def _run(redis_url: str, prompts: list[tuple[str, list[int], str | None]]) -> dict:
    q = CTX.Queue()
    p = CTX.Process(target=events_worker, args=(q, redis_url, prompts, 4))
    p.start()
    try:
        return q.get(timeout=600)
    finally:
        p.join(60)


def test_index_fed_by_kv_events_predicts_vllm_hits(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    redis.start()
    try:
        cfg = load_config(env={})
        u = cfg.prefix_match_unit
        hasher = BlockHasher(unit=u, algo=cfg.hash_algo, seed=cfg.hash_seed)
        base = _tokens(1400, 3)
        grown = base + _tokens(300, 4)
        first = _run(redis.url, [("base", base, "t1")])
        feed = first["feed"]
        assert feed["mismatches"] == 0 and feed["published_kv"] > 0 and feed["published_states"] > 0, feed
        index = PrefixIndex(redis.url, first["model_id"])
        index.heartbeat("vllm-0")
        predicted = index.lookup(hasher.chain(grown, cache_salt="t1"), len(grown), u, False).instance_hits["vllm-0"]
        other_tenant = index.lookup(hasher.chain(grown, cache_salt="t2"), len(grown), u, False).instance_hits
        assert other_tenant.get("vllm-0", 0) == 0  # the salt isolates in the index too
        # a fresh engine serves base then grown: vLLM's own hit for grown is what the index promised
        actual = _run(redis.url, [("base", base, "t1"), ("grown", grown, "t1")])["grown"]
        assert predicted == actual > 1280, (predicted, actual)  # a partial-prefix checkpoint beyond the 640-blocks
        assert predicted % u == 0
    finally:
        redis.stop()
