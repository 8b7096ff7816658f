"""The serving system through its public interfaces (openai client, grpcio).

The stack runs with EAGLE on; the reference is the native engine run
monolithically in this process with EAGLE off: equal greedy tokens show P/D,
caching, NIXL transfer and EAGLE change nothing. The equality tests run on the
shared stack (mamba_block_size B = 64) and on one at the default B = u.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import BadRequestError, NotFoundError, OpenAI

from hybridpd.checkpoints import checkpoint_position, longest_usable_hit, planned_checkpoint
from hybridpd.tokenizer import ChatMessage
from hybridpd.v1 import generate_pb2 as pb
from hybridpd.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import REPLAY, STACK_ARGS, Stack
from tests.unit.engine_helpers import prompt

U, A = 16, 16  # prefix_match_unit, checkpoint_alignment: the defaults


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def stack_bu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The shared stack's flags at the default state block size (B = u)."""
    s = Stack(Path(tmp_path_factory.mktemp("stack-bu")), STACK_ARGS)
    s.start()
    try:
        yield s
    finally:
        s.stop()


class Served(NamedTuple):
    client: OpenAI
    stack: Stack
    block: int  # mamba_block_size B


@pytest.fixture(params=["B64", "Bu"])
def served(request: pytest.FixtureRequest) -> Served:
    """The client and stack of an equality test: the shared stack (B = 64), then B = u."""
    st: Stack = request.getfixturevalue("stack" if request.param == "B64" else "stack_bu")
    return Served(
        OpenAI(base_url=st.http + "/v1", api_key="unused", max_retries=0), st, 64 if request.param == "B64" else U
    )


def _complete(client: OpenAI, tokens: list[int], max_tokens: int = 8, **extra: object):  # type: ignore[no-untyped-def]
    return client.completions.create(
        model="tiny",
        prompt=tokens,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )


@pytest.mark.parametrize("n", [1, 40, 300, 1200])
def test_completion_equals_monolithic_engine(served: Served, reference, n: int) -> None:  # type: ignore[no-untyped-def]
    client = served.client
    run, tok = reference
    tokens = list(prompt(n, 100 + n))
    want = run(tokens, 8)
    got = _complete(client, tokens)
    assert got.choices[0].token_ids == want  # type: ignore[attr-defined]
    assert got.choices[0].text == tok.decode(want)
    assert got.usage.prompt_tokens == n and got.usage.completion_tokens == len(want)
    stream = client.completions.create(
        model="tiny", prompt=tokens, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(want)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(want)


def test_chat_equals_monolithic_engine(served: Served, reference) -> None:  # type: ignore[no-untyped-def]
    client = served.client
    run, tok = reference
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]
    want = run(tok.apply_chat_template([ChatMessage(m["role"], m["content"]) for m in msgs]), 12)
    got = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert got.choices[0].message.content == tok.decode(want)
    parts = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in parts) == tok.decode(want)


def test_extension_cached_tokens_local_and_via_store(served: Served, reference) -> None:  # type: ignore[no-untyped-def]
    client, stack = served.client, served.stack
    run, _ = reference
    first = list(prompt(300, 7))
    _complete(client, first, hybridpd_prefill_instance="prefill-0")
    # the checkpoint rule (EAGLE on in this stack, no replay unit: REPLAY) says where the state was exported
    pos = checkpoint_position(len(first), U, REPLAY)
    ext = first + list(prompt(45, 8))
    promised = longest_usable_hit(len(ext), U, len(first) // U, {pos}, REPLAY)
    assert promised == pos > 0
    assert stack.wait_store_hit(ext, promised) == promised  # put in the store and published asynchronously
    same = _complete(client, ext, hybridpd_prefill_instance="prefill-0")
    assert same.usage.prompt_tokens_details.cached_tokens == promised
    # same's prefill, from the hit to the end, exports ext's own tail checkpoint where the
    # column rule lets it (B = u: at its tail; B = 64: its slot column holds the restored state)
    deeper = planned_checkpoint(promised, len(ext), len(ext), U, served.block, A, REPLAY) or promised
    assert deeper == (checkpoint_position(len(ext), U, REPLAY) if served.block == U else promised) > 0
    assert stack.wait_store_hit(ext, deeper) == deeper
    other = _complete(client, ext, hybridpd_prefill_instance="prefill-1")
    assert other.usage.prompt_tokens_details.cached_tokens == deeper  # loaded from MooncakeStore
    want = run(ext, 8)
    assert same.choices[0].token_ids == want and other.choices[0].token_ids == want  # type: ignore[attr-defined]


def test_the_next_turn_reads_only_the_new_blocks(client: OpenAI, stack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    """Decode keeps a handed-off prompt's blocks: the conversation's next turn READs
    only the blocks it lacks (a delta handoff), and its tokens stay the reference's."""
    run, _ = reference
    first = list(prompt(300, 61))
    answer = _complete(client, first).choices[0].token_ids  # type: ignore[attr-defined]
    before = stack.stats()["decode-0"]
    nxt = first + answer + list(prompt(40, 62))
    got = _complete(client, nxt)
    after = stack.stats()["decode-0"]
    assert got.choices[0].token_ids == run(nxt, 8)  # type: ignore[attr-defined]
    assert after["delta_handoffs"] - before["delta_handoffs"] == 1
    skipped = after["handoff_skipped_bytes"] - before["handoff_skipped_bytes"]
    assert skipped > 0 and skipped % (300 // U) == 0  # the first turn's 18 full blocks, not read again
    assert after["handoff_bytes_per_request"] > 0


def test_cache_salt_isolates_tenants(served: Served, reference) -> None:  # type: ignore[no-untyped-def]
    client, stack = served.client, served.stack
    run, _ = reference
    base = list(prompt(260, 11))
    _complete(client, base, cache_salt="tenant-a")
    ext = base + list(prompt(20, 12))
    stack.wait_store_hit(ext, cache_salt="tenant-a")  # tenant-a's checkpoint published: a hit anywhere
    other = _complete(client, ext, cache_salt="tenant-b")
    same = _complete(client, ext, cache_salt="tenant-a")
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    want = run(ext, 8)
    assert other.choices[0].token_ids == want and same.choices[0].token_ids == want  # type: ignore[attr-defined]


def test_ignore_eos_ignores_end_of_turn_ids_too(client: OpenAI, stack: Stack) -> None:
    """Greedy "The delta rule" ends with EOS (id 2, one of the tokenizer's stop ids)
    after 44 tokens on the trained tiny model; with ignore_eos the same request runs
    to max_tokens over both APIs, its first tokens unchanged."""
    stopped = client.completions.create(
        model="tiny", prompt="The delta rule", max_tokens=64, temperature=0, extra_body={"return_token_ids": True}
    )
    assert stopped.choices[0].finish_reason == "stop"
    n = stopped.usage.completion_tokens
    assert n < 64
    ignored = client.completions.create(
        model="tiny",
        prompt="The delta rule",
        max_tokens=64,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 64
    got = ignored.choices[0].token_ids  # type: ignore[attr-defined]
    assert got[: n - 1] == stopped.choices[0].token_ids[: n - 1]  # type: ignore[attr-defined]
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(text="The delta rule", sampling=pb.SamplingParams(max_tokens=64, ignore_eos=True))
        ids = [t for r in stub.Generate(req) for t in r.token_ids]
    assert ids == got


def test_client_disconnect_frees_blocks(stack: Stack) -> None:
    body = {
        "model": "tiny",
        "prompt": list(prompt(200, 13)),
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", stack.http + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break
    stats = stack.wait_all_free()
    assert all(s["pool"]["num_running"] == 0 for s in stats.values())


def test_bad_input_is_4xx(client: OpenAI, stack: Stack) -> None:
    with pytest.raises(BadRequestError, match="token ids"):
        client.completions.create(model="tiny", prompt=[5, 999999], max_tokens=2)
    with pytest.raises(BadRequestError, match="n must be 1 when using greedy sampling"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, n=2, temperature=0)
    with pytest.raises(BadRequestError, match="context"):  # a max_tokens past it is clamped, as vLLM does
        client.completions.create(model="tiny", prompt=[5] * 16384, max_tokens=2)
    with pytest.raises(BadRequestError, match="strictly ascending"):
        client.completions.create(
            model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=2, extra_body={"hybridpd_checkpoints": [3, 2]}
        )
    with pytest.raises(NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    r = httpx.post(stack.http + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(
        stack.http + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={"x-request-id": "abc"}
    )
    assert r.headers["x-request-id"] == "abc"
    assert httpx.get(stack.http + "/health").status_code == 200
    metrics = httpx.get(stack.http + "/metrics").text
    for name in ("hybridpd_ttft_seconds_bucket", "hybridpd_routing_decisions_total", "hybridpd_cached_tokens_total"):
        assert name in metrics
    assert 'hybridpd_ttft_stage_seconds_count{stage="prefill_call"}' in metrics


def test_grpc_generate_abort_health(stack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    channel = grpc.insecure_channel(stack.grpc)
    stub = pb_grpc.GenerationStub(channel)
    tokens = list(prompt(120, 17))
    msgs = list(
        stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokens), sampling=pb.SamplingParams(max_tokens=8)))
    )
    want = run(tokens, 8)
    assert [t for m in msgs for t in m.token_ids] == want
    # the trained model may end on EOS first: then the reason is STOP
    reason = pb.FINISH_REASON_LENGTH if len(want) == 8 else pb.FINISH_REASON_STOP
    assert msgs[-1].finish_reason == reason and msgs[-1].usage.prompt_tokens == 120
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(text="")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not stub.Abort(pb.AbortRequest(request_id="nope")).found
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="hybridpd.v1.Generation")).status == 1
    # cancelling a stream frees the work
    call = stub.Generate(
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=tokens), sampling=pb.SamplingParams(max_tokens=3000, ignore_eos=True)
        )
    )
    next(call)
    call.cancel()
    stack.wait_all_free()


def test_full_queue_is_429_with_retry_after(stack: Stack) -> None:
    """The stack admits 4 requests at a time (--max-inflight-requests 4)."""
    import concurrent.futures

    def one(i: int) -> tuple[int, str | None]:
        body = {
            "model": "tiny",
            "prompt": list(prompt(64, 200 + i)),
            "max_tokens": 300,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(stack.http + "/v1/completions", json=body, timeout=120)
        return r.status_code, r.headers.get("retry-after")

    with concurrent.futures.ThreadPoolExecutor(10) as ex:
        results = list(ex.map(one, range(10)))
    codes = [c for c, _ in results]
    assert codes.count(429) >= 1 and codes.count(200) >= 4, codes
    assert all(ra is not None and int(ra) >= 1 for c, ra in results if c == 429)
    assert set(codes) <= {200, 429}
    stack.wait_all_free()


def test_growing_streams_recompute_near_ideal(stack: Stack) -> None:
    """The benchmark's workload, small: each round recomputes about D new tokens."""
    from bench.growing_streams import Workload, run_workload

    # NOTE: D must be >= 2B (B = 64): a shorter query can end in the Mamba block
    # column its initial state occupies, and the slot-column rule (vLLM's) then
    # forbids the checkpoint: with D = 80, the round at 760 tokens exports none.
    w = Workload(streams=2, start=600, step=160, end=1080, max_tokens=2, seed=5)
    res = run_workload(stack.http, w, "e2e")
    bound = (w.step + 2 * w.unit) / w.step  # this stack runs EAGLE: the replay block costs one unit more
    assert res["incremental_requests"] == 2 * (len(w.lengths) - 1)
    assert res["recomputed_tokens_per_request"] <= bound * w.step, res
    assert res["cached_tokens_per_request"] >= w.start - 2 * w.unit, res
