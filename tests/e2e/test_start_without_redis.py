"""Start-up survives the index's Redis being down (issue #51): `hybridpd up` with an
unreachable --redis-url serves (every prompt recomputed, exact tokens), and once a
Redis listens there the index fills and prefixes hit again, without a restart."""

from __future__ import annotations

from pathlib import Path

from openai import OpenAI

from hybridpd.index.redis_server import RedisServer
from hybridpd.procs import listen_ports
from tests.e2e.conftest import Stack
from tests.unit.engine_helpers import prompt


def test_serves_without_redis_and_attaches_when_it_returns(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    (port,) = listen_ports(1)
    url = "redis://127.0.0.1:%d/0" % port
    stack = Stack(tmp_path / "stack", ["--redis-url", url, "--num-prefill", "1"])
    stack.start()
    redis = None
    try:
        assert "not reachable" in stack.log.read_text(errors="replace")
        client = OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)
        tokens = list(prompt(200, 91))

        def complete(toks: list[int]):  # type: ignore[no-untyped-def]
            return client.completions.create(
                model="tiny", prompt=toks, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
            )

        first = complete(tokens)
        assert first.choices[0].token_ids == run(tokens, 4)  # type: ignore[attr-defined]
        (tmp_path / "redis").mkdir()
        redis = RedisServer(tmp_path / "redis", port=port)
        redis.start()
        later = list(prompt(200, 92))
        complete(later)  # published now that the index is back
        assert stack.wait_store_hit(later, timeout_s=60) > 0
        again = complete([*later, *prompt(20, 93)])
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert again.choices[0].token_ids == run([*later, *prompt(20, 93)], 4)  # type: ignore[attr-defined]
    finally:
        stack.stop()
        if redis is not None:
            redis.stop()
