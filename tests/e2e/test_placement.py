"""Checkpoint placement through the public API (#27): on a fresh stack (default
config: placement value, at most two per prefill; EAGLE on, u = 16), the second of two
requests sharing a 1,200-token document, and nothing else, restores at least
0.75 of it, with outputs equal to a monolithic no-cache run; the router counts
what it placed and the index never promises more than the engine restores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import REPLAY, STACK_ARGS, Stack
from tests.unit.engine_helpers import prompt

pytestmark = pytest.mark.e2e

U = 16


@pytest.fixture(scope="module")
def pstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(Path(tmp_path_factory.mktemp("placement")), STACK_ARGS)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _complete(stack: Stack, tokens: list[int]):  # type: ignore[no-untyped-def]
    client = OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)
    return client.completions.create(
        model="tiny",
        prompt=tokens,
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True, "hybridpd_prefill_instance": "prefill-0"},
    )


def _placed(stack: Stack) -> float:
    for line in httpx.get(stack.http + "/metrics", timeout=10).text.splitlines():
        if line.startswith("hybridpd_placed_checkpoints_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no hybridpd_placed_checkpoints_total in /metrics")


def test_the_second_request_sharing_a_document_hits_it(pstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    doc = list(prompt(1200, 2701))
    first, second = doc + list(prompt(45, 2702)), doc + list(prompt(45, 2703))
    got = _complete(pstack, first)
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    assert _placed(pstack) >= 1
    got = _complete(pstack, second)
    cached = got.usage.prompt_tokens_details.cached_tokens
    ideal = 1200 // U * U - (U if REPLAY else 0)  # the document's last unit boundary (EAGLE replays nothing)
    assert 0.75 * ideal <= cached <= ideal and cached % U == 0
    promised = got.usage.model_extra["hybridpd_promised_tokens"]
    assert 0 < promised <= cached  # the index knew the placed state, and promised no more
    assert got.choices[0].token_ids == run(second, 6)  # type: ignore[attr-defined]
