"""The stack reading its prefix index from a replica (``--redis-url <primary>
--redis-read-replicas --redis-replica-url <replica>``): the router's lookups
are answered by the replica (its command counts and the router's
``hybridpd_index_lookups_total{source="replica"}`` show it), the hits it
promises are the ones the engines restore, outputs are exact; with the
replica down the same traffic is served from the primary."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from openai import OpenAI

from hybridpd.index.redis_server import RedisServer
from tests.e2e.conftest import Stack
from tests.unit.engine_helpers import prompt
from tests.wait import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def replica_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, RedisServer, RedisServer]]:
    d = Path(tmp_path_factory.mktemp("redis"))
    primary = RedisServer(d)
    replica = RedisServer(d, extra_args=["--replicaof", primary.host, str(primary.port)])
    s = Stack(Path(tmp_path_factory.mktemp("rstack")), [])
    try:
        primary.start()
        replica.start()
        link = redis.Redis(host=replica.host, port=replica.port)
        wait_until(lambda: link.info("replication").get("master_link_status") == "up", 30, 0.1, "replica link up")
        s.extra_args = [
            "--redis-url",
            primary.url,
            "--redis-read-replicas",
            "--redis-replica-url",
            replica.url,
            "--checkpoint-placement",
            "off",
        ]
        s.start()
        yield s, primary, replica
    finally:
        s.stop()
        replica.stop()
        primary.stop()


def _evalsha_calls(srv: RedisServer) -> int:
    stats = redis.Redis(host=srv.host, port=srv.port).info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def _lookups(stack: Stack, source: str) -> float:
    want = 'hybridpd_index_lookups_total{source="%s"}' % source
    lines = httpx.get(stack.http + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(want))


def _complete(stack: Stack, tokens: list[int], **extra: object):  # type: ignore[no-untyped-def]
    client = OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)
    return client.completions.create(
        model="tiny", prompt=tokens, max_tokens=6, temperature=0, extra_body={"return_token_ids": True, **extra}
    )


def _hit_round(stack: Stack, seed: int, run) -> int:  # type: ignore[no-untyped-def]
    """A prompt, then its extension: the extension's cached tokens (a hit the lookup promised)."""
    base = list(prompt(300, seed))
    first = _complete(stack, base)
    assert first.choices[0].token_ids == run(base, 6)
    tokens = base + list(prompt(40, seed + 1))
    got = _complete(stack, tokens)
    assert got.choices[0].token_ids == run(tokens, 6)
    details = got.usage.prompt_tokens_details
    return int(details.cached_tokens) if details is not None and details.cached_tokens else 0


def test_lookups_read_the_replica_and_fall_back_to_the_primary(replica_stack, reference) -> None:  # type: ignore[no-untyped-def]
    stack, primary, replica = replica_stack
    run, _ = reference
    on = (_evalsha_calls(primary), _evalsha_calls(replica), _lookups(stack, "replica"), _lookups(stack, "primary"))
    assert _hit_round(stack, 120, run) > 0
    after = (_evalsha_calls(primary), _evalsha_calls(replica), _lookups(stack, "replica"), _lookups(stack, "primary"))
    assert after[0] == on[0]  # the primary ran no lookup
    assert after[1] - on[1] >= 2 and after[2] - on[2] >= 2  # the replica ran both, the router counted them
    assert after[3] == on[3]
    replica.stop(timeout_s=2.0)
    try:
        assert _hit_round(stack, 130, run) > 0  # served, and hits, from the primary
        assert _lookups(stack, "primary") >= after[3] + 2
    finally:
        replica.start()
    link = redis.Redis(host=replica.host, port=replica.port)
    wait_until(lambda: link.info("replication").get("master_link_status") == "up", 30, 0.1, "replica link up")
    before = _lookups(stack, "replica")
    wait_until(
        lambda: _hit_round(stack, 140, run) > 0 and _lookups(stack, "replica") > before,
        30,
        0.5,
        "lookups on the returned replica",
    )
