"""The stack on a Redis Cluster (``--redis-url <a node> --redis-cluster``): the
index serves hits through the cluster; the master that owns the model's slot
is killed during traffic and requests keep being served, token for token,
routed on load (misses, never a promise the index cannot keep); when the
master returns the index fills again and hits return."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from hybridpd.errors import UnavailableError
from hybridpd.index.redis_cluster import LocalRedisCluster
from tests.e2e.conftest import Stack
from tests.unit.engine_helpers import prompt
from tests.wait import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, LocalRedisCluster]]:
    cluster = LocalRedisCluster(Path(tmp_path_factory.mktemp("cluster")), masters=3)
    s = Stack(Path(tmp_path_factory.mktemp("cstack")), [])
    try:
        cluster.start()
        s.extra_args = ["--redis-url", cluster.url, "--redis-cluster", "--checkpoint-placement", "off"]
        s.start()
        yield s, cluster
    finally:
        s.stop()
        cluster.stop()


def _complete(stack: Stack, tokens: list[int], **extra: object):  # type: ignore[no-untyped-def]
    client = OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)
    return client.completions.create(
        model="tiny", prompt=tokens, max_tokens=6, temperature=0, extra_body={"return_token_ids": True, **extra}
    )


def _metric(stack: Stack, name: str) -> float:
    lines = httpx.get(stack.http + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def _store_hit_round(stack: Stack, seed: int, reference) -> int:  # type: ignore[no-untyped-def]
    """prefill-1 computes a prefix; its extension, sent to prefill-0, loads it from the
    store as the index (on the cluster) promised. Returns the cached tokens."""
    run, _ = reference
    base = list(prompt(300, seed))
    _complete(stack, base, hybridpd_prefill_instance="prefill-1")
    tokens = base + list(prompt(40, seed + 1))
    stack.wait_store_hit(tokens)
    got = _complete(stack, tokens, hybridpd_prefill_instance="prefill-0")
    assert got.choices[0].token_ids == run(tokens, 6)
    return int(got.usage.prompt_tokens_details.cached_tokens)


def test_a_shard_lost_during_traffic_serves_on_and_recovers(cluster_stack, reference) -> None:  # type: ignore[no-untyped-def]
    stack, cluster = cluster_stack
    run, _ = reference
    assert stack.banner("Redis (prefix index)") == cluster.url
    assert _store_hit_round(stack, 70, reference) > 0  # hits through the cluster
    home = cluster.master_of(stack.index.keys.instances)
    unavailable = 'hybridpd_routing_decisions_total{decision="index_unavailable"}'
    before = _metric(stack, unavailable)
    cluster.stop_node(home)
    for seed in (80, 81, 82):  # traffic while the model's shard is gone: served, exact, routed on load
        tokens = list(prompt(200, seed))
        got = _complete(stack, tokens)
        assert got.choices[0].token_ids == run(tokens, 6)
        assert got.usage.prompt_tokens_details is None or got.usage.prompt_tokens_details.cached_tokens == 0
    assert _metric(stack, unavailable) >= before + 3
    cluster.start_node(home)
    wait_until(  # heartbeats re-register both instances on the returned (empty) master
        lambda: {"prefill-0", "prefill-1"} <= set(stack.index.live_instances()),
        30,
        0.2,
        "both prefill instances' heartbeats on the returned master",
        retry_on=(UnavailableError,),
    )
    assert _store_hit_round(stack, 90, reference) > 0
